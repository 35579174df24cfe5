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
 * Work is split into contiguous slabs, one per thread (run_slabs); each slab is done in
 * blocks that stay in the L1 cache while the steps are added into them.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { DT_FP32 = 0, DT_BF16 = 1, DT_FP16 = 2 };
#define MAX_STEPS 64
#define BLOCK 2048
#define MAX_THREADS 256
#define SLAB_ALIGN 64
#define MAX_ARGS_BYTES 256

/* The elements [lo, hi) one thread does; the first member of every kernel's arguments. */
typedef struct {
  int64_t lo, hi;
} slab;

/* Runs worker over n elements split into contiguous slabs, one per thread (pthreads; no
 * OpenMP runtime is added to the process): each thread gets a copy of the size bytes at
 * args with its slab set. A slab whose thread could not be started is done by the calling
 * thread; returns how many threads could not be started (the work is complete either
 * way). */
static int run_slabs(void *(*worker)(void *), const void *args, size_t size, int64_t n,
                     int threads) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (n < (int64_t)threads * 65536) threads = (int)(n / 65536) + 1;
  unsigned char each[MAX_THREADS][MAX_ARGS_BYTES] __attribute__((aligned(64)));
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS];
  int64_t per = (n + threads - 1) / threads;
  per = (per + SLAB_ALIGN - 1) / SLAB_ALIGN * SLAB_ALIGN;
  int failed = 0;
  for (int t = 0; t < threads; ++t) {
    int64_t lo = (int64_t)t * per, hi = lo + per;
    if (lo > n) lo = n;
    if (hi > n) hi = n;
    memcpy(each[t], args, size);
    ((slab *)each[t])->lo = lo;
    ((slab *)each[t])->hi = hi;
    started[t] = 0;
    if (t > 0 && lo < hi) {
      started[t] = pthread_create(&tids[t], NULL, worker, each[t]) == 0;
      if (!started[t]) failed++;
    }
  }
  worker(each[0]);
  for (int t = 1; t < threads; ++t) {
    if (started[t]) {
      pthread_join(tids[t], NULL);
    } else if (((slab *)each[t])->lo < ((slab *)each[t])->hi) {
      worker(each[t]);
    }
  }
  return failed;
}

typedef struct {
  slab s;
  float *acc;
  const void *const *grads;
  int dtype;
  int count;
  const int *has_inv;
  const float *inv;
  const int *has_clip;
  const float *clip;
  int first;
  int has_div;
  float divisor;
} acc_args;
_Static_assert(sizeof(acc_args) <= MAX_ARGS_BYTES, "acc_args too large");

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
  for (int64_t lo = a->s.lo; lo < a->s.hi; lo += BLOCK) {
    const int64_t m = a->s.hi - lo < BLOCK ? a->s.hi - lo : BLOCK;
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

/* acc[0:n] (+)= sum over k of grads[k] * inv[k] * clip[k], then / divisor; see the header
 * comment. A slab whose thread could not be started is done by the calling thread; returns
 * how many threads could not be started (the work is complete either way), or -1 when
 * count is not within 1..MAX_STEPS (nothing done). */
int mext_accumulate(float *acc, const void *const *grads, int dtype, int count, int64_t n,
                    const int *has_inv, const float *inv, const int *has_clip,
                    const float *clip, int first, int has_div, float divisor, int threads) {
  if (count < 1 || count > MAX_STEPS) return -1;
  const acc_args args = {{0, 0}, acc, grads, dtype, count, has_inv, inv, has_clip, clip,
                         first, has_div, divisor};
  return run_slabs(acc_worker, &args, sizeof args, n, threads);
}

/* ------------------------------------------------------------------ AdamW
 *
 * One AdamW step (decoupled weight decay, torch's AdamW) over fp32 tensors in one pass:
 * each element of the master, gradient and both moments is read once and written once.
 * Torch's fused CPU kernel is fast but its results depend on where an element sits in
 * the call (its vector loop and its scalar tail round differently), so the same states
 * cut into other pieces (offload subgroups, a ZenFlow re-selection's new layout) would
 * take other bits. Here every element takes the same operations wherever it sits and
 * however the work is split: IEEE fp32 operations, the fused multiply-adds written out
 * where torch's reference AdamW has them (lerp, addcmul), nothing else contracted
 * (-ffp-contract=off):
 *   p = p * (1 - lr * wd)                        (1 when wd = 0: p unchanged)
 *   m = fma(w1, g - m, m)      w1 = 1 - beta1    (torch's lerp; fma(w1 - 1, g - m, g)
 *                                                 when |w1| >= 0.5)
 *   v = fma((1 - beta2) * g, g, v * beta2)       (mul_, then addcmul_)
 *   p = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
 * The scalars come in as fp32, computed by the caller as torch computes them (in double,
 * then rounded). The square root is IEEE's (torch's CPU sqrt may differ from it in the
 * last bit), so results equal torch's reference AdamW to rounding, not bit for bit. Work
 * is split into slabs by run_slabs. */

typedef struct {
  slab s;
  float *p;
  const float *g;
  float *m;
  float *v;
  float c_wd, w1, b2, s2, bc2s, eps, neg_step;
} adam_args;
_Static_assert(sizeof(adam_args) <= MAX_ARGS_BYTES, "adam_args too large");

#define ADAM_LOOP(BASE)                                              \
  for (int64_t i = 0; i < n; ++i) {                                  \
    const float gi = g[i], mo = m[i];                                \
    const float mi = __builtin_fmaf(coeff, gi - mo, BASE);           \
    const float vi = __builtin_fmaf(s2 * gi, gi, v[i] * b2);         \
    const float den = __builtin_sqrtf(vi) / bc2s + eps;              \
    p[i] = p[i] * c_wd + (neg_step * mi) / den;                      \
    m[i] = mi;                                                       \
    v[i] = vi;                                                       \
  }

static void *adam_worker(void *arg) {
  const adam_args *a = (const adam_args *)arg;
  float *restrict p = a->p + a->s.lo;
  const float *restrict g = a->g + a->s.lo;
  float *restrict m = a->m + a->s.lo;
  float *restrict v = a->v + a->s.lo;
  const int64_t n = a->s.hi - a->s.lo;
  const float c_wd = a->c_wd, b2 = a->b2, s2 = a->s2, bc2s = a->bc2s, eps = a->eps;
  const float neg_step = a->neg_step;
  /* torch's lerp: fma(weight, end - start, start) for a small weight, else
   * fma(weight - 1, end - start, end). */
  const int small = a->w1 < 0.5f && a->w1 > -0.5f;
  const float coeff = small ? a->w1 : a->w1 - 1.0f;
  if (small) {
    ADAM_LOOP(mo)
  } else {
    ADAM_LOOP(gi)
  }
  return NULL;
}

/* One AdamW step over n elements (see above); returns how many threads could not be
 * started (their slabs are done by the calling thread: the work is complete either way). */
int mext_adamw(float *p, const float *g, float *m, float *v, int64_t n, float c_wd,
               float w1, float b2, float s2, float bc2s, float eps, float neg_step,
               int threads) {
  const adam_args args = {{0, 0}, p, g, m, v, c_wd, w1, b2, s2, bc2s, eps, neg_step};
  return run_slabs(adam_worker, &args, sizeof args, n, threads);
}
