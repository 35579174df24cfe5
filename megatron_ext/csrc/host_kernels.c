/* Host-memory kernels for ZenFlow's CPU side (loaded with ctypes by
 * megatron_ext/runtime/host_kernels.py, built with -ffp-contract=off).
 *
 * Each kernel makes one pass over memory where torch needs several: accumulating a step's
 * gradients into an fp32 window accumulator reads the gradient in its training dtype and
 * the accumulator once, instead of converting through a temporary, multiplying it in place
 * and adding it (three passes, two of them over a full-size fp32 temporary).
 *
 * The arithmetic is torch's, operation by operation, in the same order and in fp32 (no
 * fused multiply-add: -ffp-contract=off), so the results are the same bit for bit:
 *   x = float(grad); x = x * inv_scale; x = x * clip; acc = acc + x  (or 0 + x);
 *   acc = acc / divisor.
 * Work is split into contiguous slabs, one per thread (pthreads; no OpenMP runtime is
 * added to the process).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { DT_FP32 = 0, DT_BF16 = 1, DT_FP16 = 2 };

typedef struct {
  float *acc;
  const void *grad;
  int dtype;
  int64_t lo, hi;
  int has_inv;
  float inv;
  int has_clip;
  float clip;
  int first;
  int has_div;
  float divisor;
} acc_args;

static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

#define ACC_LOOP(LOAD)                                   \
  for (int64_t i = a->lo; i < a->hi; ++i) {              \
    float x = LOAD;                                      \
    if (has_inv) x = x * inv;                            \
    if (has_clip) x = x * clip;                          \
    float s = first ? 0.0f + x : acc[i] + x;             \
    if (has_div) s = s / divisor;                        \
    acc[i] = s;                                          \
  }

static void *acc_worker(void *p) {
  const acc_args *a = (const acc_args *)p;
  float *restrict acc = a->acc;
  const int has_inv = a->has_inv, has_clip = a->has_clip, first = a->first;
  const int has_div = a->has_div;
  const float inv = a->inv, clip = a->clip, divisor = a->divisor;
  if (a->dtype == DT_BF16) {
    const uint16_t *restrict g = (const uint16_t *)a->grad;
    ACC_LOOP(bf16_to_f32(g[i]))
  } else if (a->dtype == DT_FP16) {
    const _Float16 *restrict g = (const _Float16 *)a->grad;
    ACC_LOOP((float)g[i])
  } else {
    const float *restrict g = (const float *)a->grad;
    ACC_LOOP(g[i])
  }
  return NULL;
}

#define MAX_THREADS 256
#define SLAB_ALIGN 64

/* acc[0:n] (+)= grad * inv_scale * clip, then / divisor; see the header comment.
 * A slab whose thread could not be started is done by the calling thread; returns how many
 * threads could not be started (the work is complete either way). */
int mext_accumulate(float *acc, const void *grad, int dtype, int64_t n, int has_inv,
                    float inv, int has_clip, float clip, int first, int has_div,
                    float divisor, int threads) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (n < (int64_t)threads * 65536) threads = (int)(n / 65536) + 1;
  acc_args args[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS];
  int64_t per = (n + threads - 1) / threads;
  per = (per + SLAB_ALIGN - 1) / SLAB_ALIGN * SLAB_ALIGN;
  int failed = 0;
  for (int t = 0; t < threads; ++t) {
    int64_t lo = (int64_t)t * per, hi = lo + per;
    if (lo > n) lo = n;
    if (hi > n) hi = n;
    args[t] = (acc_args){acc, grad, dtype, lo, hi, has_inv, inv, has_clip, clip, first,
                         has_div, divisor};
    started[t] = 0;
    if (t > 0 && lo < hi) {
      started[t] = pthread_create(&tids[t], NULL, acc_worker, &args[t]) == 0;
      if (!started[t]) failed++;
    }
  }
  acc_worker(&args[0]);
  for (int t = 1; t < threads; ++t) {
    if (started[t]) {
      pthread_join(tids[t], NULL);
    } else if (args[t].lo < args[t].hi) {
      acc_worker(&args[t]);
    }
  }
  return failed;
}
