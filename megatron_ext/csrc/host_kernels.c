/* Host-memory kernels for ZenFlow's CPU side (loaded with ctypes by
 * megatron_ext/runtime/host_kernels.py, built with -ffp-contract=off).
 *
 * Each kernel makes one pass over memory where torch needs several: accumulating steps'
 * gradients into an fp32 window accumulator reads each gradient in its training dtype and
 * the accumulator once, instead of converting through a temporary, multiplying it in place
 * and adding it (three passes per step, two of them over a full-size fp32 temporary). One
 * call can take several steps' gradients: the accumulator is then read and written once
 * for all of them (ZenFlow's staging slots hold a few steps of gradients on the host).
 *
 * The arithmetic is torch's, operation by operation, in the same order and in fp32 (no
 * fused multiply-add: -ffp-contract=off), so the results are the same bit for bit as
 * accumulating the steps one after the other:
 *   for each step k: x = float(grad_k); x = x * inv_scale_k; x = x * clip_k;
 *                    acc = acc + x  (0 + x for the window's first step);
 *   acc = acc / divisor.
 * Work is split into contiguous slabs, one per thread (pthreads; no OpenMP runtime is
 * added to the process); each slab is done in blocks that stay in the L1 cache while the
 * steps are added into them.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { DT_FP32 = 0, DT_BF16 = 1, DT_FP16 = 2 };
#define MAX_STEPS 64
#define BLOCK 2048

typedef struct {
  float *acc;
  const void *const *grads;
  int dtype;
  int count;
  int64_t lo, hi;
  const int *has_inv;
  const float *inv;
  const int *has_clip;
  const float *clip;
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

#define ADD_STEP(LOAD)                                   \
  for (int64_t j = 0; j < m; ++j) {                      \
    float x = LOAD;                                      \
    if (has_inv) x = x * inv;                            \
    if (has_clip) x = x * clip;                          \
    s[j] = s[j] + x;                                     \
  }

static void *acc_worker(void *p) {
  const acc_args *a = (const acc_args *)p;
  float s[BLOCK];
  for (int64_t lo = a->lo; lo < a->hi; lo += BLOCK) {
    const int64_t m = a->hi - lo < BLOCK ? a->hi - lo : BLOCK;
    float *restrict acc = a->acc + lo;
    if (a->first) {
      for (int64_t j = 0; j < m; ++j) s[j] = 0.0f;
    } else {
      for (int64_t j = 0; j < m; ++j) s[j] = acc[j];
    }
    for (int k = 0; k < a->count; ++k) {
      const int has_inv = a->has_inv[k], has_clip = a->has_clip[k];
      const float inv = a->inv[k], clip = a->clip[k];
      if (a->dtype == DT_BF16) {
        const uint16_t *restrict g = (const uint16_t *)a->grads[k] + lo;
        ADD_STEP(bf16_to_f32(g[j]))
      } else if (a->dtype == DT_FP16) {
        const _Float16 *restrict g = (const _Float16 *)a->grads[k] + lo;
        ADD_STEP((float)g[j])
      } else {
        const float *restrict g = (const float *)a->grads[k] + lo;
        ADD_STEP(g[j])
      }
    }
    if (a->has_div) {
      const float d = a->divisor;
      for (int64_t j = 0; j < m; ++j) acc[j] = s[j] / d;
    } else {
      memcpy(acc, s, (size_t)m * sizeof(float));
    }
  }
  return NULL;
}

#define MAX_THREADS 256
#define SLAB_ALIGN 64

/* acc[0:n] (+)= sum over k of grads[k] * inv[k] * clip[k], then / divisor; see the header
 * comment. A slab whose thread could not be started is done by the calling thread; returns
 * how many threads could not be started (the work is complete either way), or -1 when
 * count is not within 1..MAX_STEPS (nothing done). */
int mext_accumulate(float *acc, const void *const *grads, int dtype, int count, int64_t n,
                    const int *has_inv, const float *inv, const int *has_clip,
                    const float *clip, int first, int has_div, float divisor, int threads) {
  if (count < 1 || count > MAX_STEPS) return -1;
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
    args[t] = (acc_args){acc, grads, dtype, count, lo, hi, has_inv, inv, has_clip, clip,
                         first, has_div, divisor};
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
