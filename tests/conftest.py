"""pytest configuration of the whole suite; shared helpers live in mext_testing.py."""
