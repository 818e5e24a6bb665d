/* cothink's fused CPU kernels for decode-sized work, called through ctypes (cothink/ops/native.py).
 *
 * A decode step spends more time dispatching small torch ops than computing them: an RMSNorm is
 * eight ops (~18 us for one row), a view attention of one query ~200 us of which the kernel is ~40.
 * Each function here does one of those units in a single call. ct_linear runs the products of steps
 * of a few rows, bound by reading the weight; it and the attentions split their work over threads
 * (below, `parallel_for`: a helper team of our own, or torch's OpenMP team), the rest run on the
 * calling thread.
 * ct_decode_layers chains them over all decoder layers of a small decode step (Llama, Qwen3, the
 * Qwen3.5 hybrid), and its final norm and lm_head.
 *
 * Tensors arrive as data pointers with their row strides (elements); the last dimension is always
 * contiguous. `bf` selects the storage type: 0 float32, 1 bfloat16. Arithmetic is float32, and every
 * rounding the torch path makes to the model dtype is made here too (`rnd`), so for float32 the
 * element-wise kernels match torch to the bit and for bfloat16 to its rounding of a float result.
 * Built with -ffp-contract=off so that a*b + c*d is never fused into one rounding.
 */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* The version of this library's interface (the ct_* signatures and the tables they read), raised with
 * every change to it; native.py (ABI_VERSION) calls only a library that reports its own. */
#define CT_ABI_VERSION 17

int ct_abi_version(void) { return CT_ABI_VERSION; }

typedef uint16_t bf16;

static inline float from_bf16(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, NaN kept quiet: the conversion torch (c10::BFloat16) makes */
static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float load(const void *p, int64_t i, int bf) {
    return bf ? from_bf16(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int bf) {
    if (bf)
        ((bf16 *)p)[i] = to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* exp(x) in a form the compiler vectorises (libm's expf is a scalar call): Cody-Waite reduction to
 * r in [-ln2/2, ln2/2], a degree-6 polynomial, 2^n by exponent bits. Within 2 ulp of expf for x in
 * [-87, 88]; 0 below (where the softmax's and the SiLU's callers want 0), +inf above. */
static inline float fast_exp(float x) {
    float z = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest by the 1.5 * 2^23 trick: plain arithmetic, vectorises where rintf/floorf may not */
    float n = (z * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = z - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    float y = p * scale;
    y = x < -87.0f ? 0.0f : y;
    return x > 88.0f ? INFINITY : y;
}

/* the value x takes once stored in the model dtype */
static inline float rnd(float x, int bf) { return bf ? from_bf16(to_bf16(x)) : x; }

static void load_row(const void *p, int64_t n, int bf, float *out) {
    if (bf) {
        const bf16 *h = (const bf16 *)p;
        for (int64_t i = 0; i < n; i++) out[i] = from_bf16(h[i]);
    } else {
        memcpy(out, p, (size_t)n * sizeof(float));
    }
}

static void store_row(void *p, const float *x, int64_t n, int bf) {
    if (bf) {
        bf16 *h = (bf16 *)p;
        for (int64_t i = 0; i < n; i++) h[i] = to_bf16(x[i]);
    } else {
        memcpy(p, x, (size_t)n * sizeof(float));
    }
}

/* x[i] <- the value it takes once stored in the model dtype (a separate pass: loops stay branch-free) */
static void round_row(float *x, int64_t n, int bf) {
    if (bf)
        for (int64_t i = 0; i < n; i++) x[i] = from_bf16(to_bf16(x[i]));
}

/* Channels i0 .. i1-1 of a rotated head (bf constant after inlining): x*cos + partner*sin with each
 * product rounded to the dtype, the partner of channel i being x[i + shift] */
static inline __attribute__((always_inline)) void rotate_span(const float *x, const void *cos, const void *sin,
                                                              int64_t i0, int64_t i1, int64_t shift, float *out,
                                                              const int bf) {
    for (int64_t i = i0; i < i1; i++)
        out[i] = rnd(rnd(x[i] * load(cos, i, bf), bf) + rnd(x[i + shift] * load(sin, i, bf), bf), bf);
}

/* Rotary embedding of one head x[d] with prepared tables (cos, sign-folded sin) over the first `rot`
 * channels, as Rotary.apply_prepared: x*cos + roll(x, rot/2)*sin, each product rounded to the dtype.
 * One pass per half (the roll's partner is rot/2 ahead, then behind), where a pass per operation over
 * copies of the tables took ~2x as long at 64 channels. */
static void rotate(const float *x, int64_t d, int64_t rot, const void *cos, const void *sin, int bf,
                   float *out) {
    int64_t half = rot / 2;
    if (bf) {
        rotate_span(x, cos, sin, 0, half, half, out, 1);
        rotate_span(x, cos, sin, half, rot, -half, out, 1);
    } else {
        rotate_span(x, cos, sin, 0, half, half, out, 0);
        rotate_span(x, cos, sin, half, rot, -half, out, 0);
    }
    for (int64_t i = rot; i < d; i++) out[i] = x[i];
}

/* Sums of 16 lanes: the loops vectorise without reassociating (no -ffast-math), and the lanes are
 * folded as a tree (8+8, 4+4, ...) rather than one after another, a chain 4 adds long, not 16. */
static inline float fold16(float *acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float sum(const float *x, int64_t n) {
    float acc[16] = {0};
    int64_t body = n - n % 16;
    for (int64_t i = 0; i < body; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j];
    for (int64_t i = body; i < n; i++) acc[i - body] += x[i];
    return fold16(acc);
}

/* x[0]^2 + ... + x[n-1]^2 in double (the norms' sums: no float rounding before the mean), in 16 lanes
 * folded as a tree as `sum` does: one chain of double adds ran 4 cycles an element (a 2048-token
 * prefill's norms were 5% of it) */
static double sum_squares(const float *x, int64_t n) {
    double acc[16] = {0};
    int64_t body = n - n % 16;
    for (int64_t i = 0; i < body; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += (double)x[i + j] * x[i + j];
    for (int64_t i = body; i < n; i++) acc[i - body] += (double)x[i] * x[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* x sigmoid(x) with libm's exp (the Gated DeltaNet kernels' SiLU) */
static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* 1 / (1 + exp(-x)) with libm's exp (beta, the attention output gate) */
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* RMSNorm of `rows` rows of x (row stride xs), optionally after adding a residual: s = x + res
 * (rounded to the dtype, written to sum_out), out = norm(s). Llama/Qwen3 scale after the cast
 * (w * dtype(normed)); zero-centred (Qwen3.5) scales in float by (1 + w), then casts. */
typedef struct {
    const void *x, *res, *w;
    void *sum_out, *out;
    int64_t xs, rs, dim;
    float eps;
    int zero_centred, bf;
} NormJob;

/* One row of a NormJob (bf constant after inlining: the loops vectorise): s = x (+ res, rounded, also
 * to sum_out) in one pass, its sum of squares, then the scaled row straight to out, where a pass per
 * operation over float copies of the rows took ~1.6x as long (512 rows of 576, one thread). */
static inline __attribute__((always_inline)) void norm_row(const NormJob *j, int64_t r, float *s, const float *wf,
                                                           const int bf) {
    int64_t dim = j->dim, size = bf ? 2 : 4;
    const char *x = (const char *)j->x + r * j->xs * size;
    const char *res = j->res ? (const char *)j->res + r * j->rs * size : NULL;
    char *sum_out = (char *)j->sum_out + r * dim * size, *out = (char *)j->out + r * dim * size;
    for (int64_t i = 0; i < dim; i++) {
        float v = load(x, i, bf);
        if (res) {
            v = rnd(v + load(res, i, bf), bf);
            store(sum_out, i, v, bf);
        }
        s[i] = v;
    }
    float inv = 1.0f / sqrtf((float)(sum_squares(s, dim) / (double)dim) + j->eps);
    if (j->zero_centred)
        for (int64_t i = 0; i < dim; i++) store(out, i, s[i] * inv * (1.0f + wf[i]), bf);
    else
        for (int64_t i = 0; i < dim; i++) store(out, i, rnd(s[i] * inv, bf) * wf[i], bf);
}

static void norm_rows(void *ctx, int64_t begin, int64_t end) {
    const NormJob *j = ctx;
    float *s = malloc((size_t)j->dim * sizeof(float)), *wf = malloc((size_t)j->dim * sizeof(float));
    load_row(j->w, j->dim, j->bf, wf);
    for (int64_t r = begin; r < end; r++) {
        if (j->bf)
            norm_row(j, r, s, wf, 1);
        else
            norm_row(j, r, s, wf, 0);
    }
    free(s);
    free(wf);
}

/* silu(gate) * up for rows of gate_up = [gate | up] (row stride gs, `inter` channels each);
 * silu is rounded to the dtype before the product, as torch computes F.silu(gate) * up. */
typedef struct {
    const void *gate_up;
    void *out;
    int64_t gs, inter;
    int bf;
} SiluJob;

/* One row of a SiluJob in one pass (bf constant after inlining): each output from its gate and up as
 * they are loaded, where four passes over float copies of the row took ~1.5x as long. */
static inline __attribute__((always_inline)) void silu_row(const SiluJob *j, int64_t r, const int bf) {
    int64_t inter = j->inter, size = bf ? 2 : 4;
    const char *gate = (const char *)j->gate_up + r * j->gs * size, *up = gate + inter * size;
    char *out = (char *)j->out + r * inter * size;
    for (int64_t i = 0; i < inter; i++) {
        float g = load(gate, i, bf);
        store(out, i, rnd(g / (1.0f + fast_exp(-g)), bf) * load(up, i, bf), bf);
    }
}

static void silu_rows(void *ctx, int64_t begin, int64_t end) {
    const SiluJob *j = ctx;
    for (int64_t r = begin; r < end; r++) {
        if (j->bf)
            silu_row(j, r, 1);
        else
            silu_row(j, r, 0);
    }
}

/* Gated DeltaNet's output norm (models/transformer.py GatedRMSNorm) over x [T * heads, dim]
 * (contiguous) with the gate z [T, heads, dim] (token stride zs, heads contiguous): per row the
 * RMSNorm rounded to the dtype, times w rounded, times silu(z) in float32, rounded once, into out
 * [T * heads, dim], as the torch module computes it. */
void ct_gated_rms_norm(const void *x, const void *z, int64_t zs, const void *w, void *out, int64_t tokens,
                       int64_t heads, int64_t dim, float eps, int bf) {
    float *xf = malloc((size_t)dim * sizeof(float));
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t r = t * heads + h, zr = t * zs + h * dim;
            load_row((const char *)x + r * dim * (bf ? 2 : 4), dim, bf, xf);
            float inv = 1.0f / sqrtf((float)(sum_squares(xf, dim) / (double)dim) + eps);
            for (int64_t i = 0; i < dim; i++) {
                float normed = rnd(xf[i] * inv, bf);
                float scaled = rnd(load(w, i, bf) * normed, bf);
                store(out, r * dim + i, scaled * silu(load(z, zr + i, bf)), bf);
            }
        }
    free(xf);
}

/* Gated DeltaNet's per-token gates for `rows` rows of b and a [rows, heads] (row stride rs, model
 * dtype): beta = sigmoid(b) rounded to the dtype, g = -exp(a_log) * softplus(a + dt_bias) (a_log and
 * dt_bias [heads] of the dtype), both float32 [rows, heads], as models/transformer.py `_gates`. */
void ct_gdn_gates(const void *b, const void *a, int64_t rs, const void *a_log, const void *dt_bias, float *g,
                  float *beta, int64_t rows, int64_t heads, int bf) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float bv = load(b, r * rs + h, bf), x = load(a, r * rs + h, bf) + load(dt_bias, h, bf);
            float softplus = x > 20.0f ? x : log1pf(expf(x)); /* torch's threshold */
            beta[r * heads + h] = rnd(sigmoid(bv), bf);
            g[r * heads + h] = -expf(load(a_log, h, bf)) * softplus;
        }
}

/* One token of a Gated DeltaNet layer from its state (ops/gdn.py, the torch path's order of work):
 * the depthwise causal conv over the W-1 pre-conv rows before it (history [w1, C], row stride hs) and
 * its own row [C], times conv_w [C, W], then SiLU (the products, their sum and the SiLU each rounded to
 * the model dtype, as `causal_conv`); q and k (the first two key_dim channels, hk heads of kd)
 * l2-normalised per head with `eps`, q scaled by kd^-1/2, value head h reading key head
 * h / (hv / hk); then the gated delta rule per value head in float32:
 *     S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  out = q^T S
 * from state_in [hv, kd, vd] into state_out (a new buffer: the old state may be cached), out [hv, vd]. */
void ct_gdn_token(const void *history, int64_t hs, int64_t w1, const void *row, const void *conv_w,
                  int64_t conv_dim, int64_t hk, int64_t hv, int64_t kd, int64_t vd, const float *g,
                  const float *beta, const float *state_in, float *state_out, float *out, float eps, int bf) {
    int64_t w = w1 + 1, key_dim = hk * kd;
    float *post = malloc((size_t)conv_dim * sizeof(float)), *mem = malloc((size_t)vd * sizeof(float));
    for (int64_t c = 0; c < conv_dim; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < w; j++) {
            float x = j < w1 ? load(history, j * hs + c, bf) : load(row, c, bf);
            acc += rnd(x * load(conv_w, c * w + j, bf), bf);
        }
        float y = rnd(acc, bf);
        post[c] = rnd(silu(y), bf);
    }
    float *q = post, *k = post + key_dim, *v = post + 2 * key_dim, q_scale = 1.0f / sqrtf((float)kd);
    for (int64_t h = 0; h < 2 * hk; h++) { /* the q heads, then the k heads: contiguous */
        float *x = post + h * kd;
        float r = 1.0f / sqrtf((float)sum_squares(x, kd) + eps);
        for (int64_t i = 0; i < kd; i++) x[i] *= r;
    }
    for (int64_t i = 0; i < key_dim; i++) q[i] *= q_scale;
    for (int64_t h = 0; h < hv; h++) {
        const float *qh = q + (h / (hv / hk)) * kd, *kh = k + (h / (hv / hk)) * kd, *vh = v + h * vd;
        const float *src = state_in + h * kd * vd;
        float *st = state_out + h * kd * vd, *o = out + h * vd, decay = expf(g[h]);
        for (int64_t e = 0; e < vd; e++) mem[e] = 0.0f;
        for (int64_t i = 0; i < kd; i++)
            for (int64_t e = 0; e < vd; e++) {
                st[i * vd + e] = src[i * vd + e] * decay;
                mem[e] += kh[i] * st[i * vd + e];
            }
        for (int64_t e = 0; e < vd; e++) mem[e] = (vh[e] - mem[e]) * beta[h]; /* the delta */
        for (int64_t e = 0; e < vd; e++) o[e] = 0.0f;
        for (int64_t i = 0; i < kd; i++)
            for (int64_t e = 0; e < vd; e++) {
                st[i * vd + e] += kh[i] * mem[e];
                o[e] += qh[i] * st[i * vd + e];
            }
    }
    free(post);
    free(mem);
}

/* ---- threads -------------------------------------------------------------------------------
 * The products and the attentions split their work over up to `threads` threads (the step's torch
 * thread count, which the engine's ThreadChooser lowers to one when another process takes a core):
 * one core does not draw the memory bandwidth two do (a float32 sum over 256 MiB here: ~15 GB/s on
 * one thread, 18-29 on two). Tasks (weight rows, items) are claimed a grain at a time, so a thread that
 * is late or descheduled does less; each task is computed whole by one thread, in the same order
 * whatever the thread count, so results do not depend on it.
 *
 * Two teams, for two kinds of call (measured on two Zen 4 cores, docs/runtime.md):
 * - The attentions outside a fused step (a wide step's decode attention, a prefill chunk's) run on
 *   OpenMP's threads, between torch's ops: the library links the OpenMP runtime torch loaded (the
 *   same libgomp.so.1, found loaded by its soname), so a call from the compute thread runs on the very
 *   team torch's own ops on that thread use. A team of our own beside it left each side's idle threads
 *   spinning on the cores the other needed: a 32-row step's attention output product, right after the
 *   C decode attention, took ~0.9 ms for ~70 us of work (one team: a 2048-token prefill +8-12%, 48
 *   coroutines +10-40% now that wide steps attend on every thread).
 * - The products (decode-sized: a few rows, or int8/4-bit weights) and everything in a fused step
 *   (ct_decode_layers, no torch op between its calls) run on helper threads of our own, because an
 *   OpenMP region ends at a barrier that waits for every thread of the team, also one still waking
 *   up, where the helpers below are never waited for unless inside the loop: on OpenMP's team
 *   bfloat16 decode was ~8% slower (72 -> 66 tok/s). */
typedef void (*task_fn)(void *ctx, int64_t begin, int64_t end);

/* The helper team: the calling thread and up to `threads - 1` helpers. The caller never waits for a
 * helper that has not joined, only for one inside the loop, finishing its grain. Idle helpers spin
 * for SPIN_NS (the gaps between a fused step's calls), then sleep on a condition variable. */

#define MAX_HELPERS 15
#define SPIN_NS 100000

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_flag busy;      /* a loop is running (a second calling thread runs its loop alone) */
    _Atomic int64_t gen;   /* the number of the latest loop */
    atomic_int open;       /* helpers may still join it */
    atomic_int active;     /* helpers inside it */
    atomic_int sleeping;   /* helpers waiting on `wake` */
    _Atomic int64_t next;  /* its first unclaimed task */
    _Atomic int64_t helped; /* grains run by helpers, ever (ct_helper_grains: tests, diagnostics) */
    int helpers;           /* helpers started (changed by the thread holding `busy`) */
    int fork_handler;      /* team_after_fork is registered (a child inherits the registration) */
    int wanted;            /* helpers that may join the current loop */
    task_fn fn;
    void *ctx;
    int64_t tasks, grain;
} team = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .busy = ATOMIC_FLAG_INIT};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void claim_tasks(int helper) {
    for (;;) {
        int64_t b = atomic_fetch_add(&team.next, team.grain);
        if (b >= team.tasks) return;
        if (helper) atomic_fetch_add(&team.helped, 1);
        team.fn(team.ctx, b, b + team.grain < team.tasks ? b + team.grain : team.tasks);
    }
}

/* the number of the next loop after `seen`: spin for SPIN_NS, then sleep until it comes */
static int64_t next_loop(int64_t seen) {
    int64_t g, start = now_ns();
    for (int i = 1;; i++) {
        if ((g = atomic_load(&team.gen)) != seen) return g;
        cpu_relax();
        if (i % 256 == 0 && now_ns() - start > SPIN_NS) break;
    }
    pthread_mutex_lock(&team.lock);
    atomic_fetch_add(&team.sleeping, 1);
    while ((g = atomic_load(&team.gen)) == seen) pthread_cond_wait(&team.wake, &team.lock);
    atomic_fetch_sub(&team.sleeping, 1);
    pthread_mutex_unlock(&team.lock);
    return g;
}

static void *helper_main(void *arg) {
    int index = (int)(intptr_t)arg;
    int64_t seen = 0;
    for (;;) {
        int64_t g = seen = next_loop(seen);
        atomic_fetch_add(&team.active, 1);
        /* inside `active` the caller cannot close this loop and start another: the fields are g's */
        if (atomic_load(&team.open) && atomic_load(&team.gen) == g && index < team.wanted) claim_tasks(1);
        atomic_fetch_sub(&team.active, 1);
    }
    return NULL;
}

/* a child process has none of the parent's helpers, and may have copied a held lock */
static void team_after_fork(void) {
    pthread_mutex_init(&team.lock, NULL);
    pthread_cond_init(&team.wake, NULL);
    atomic_flag_clear(&team.busy);
    atomic_store(&team.open, 0);
    atomic_store(&team.active, 0);
    atomic_store(&team.sleeping, 0);
    team.helpers = 0;
}

static void team_for(task_fn fn, void *ctx, int64_t tasks, int64_t grain, int64_t threads) {
    int want = threads - 1 < MAX_HELPERS ? (int)threads - 1 : MAX_HELPERS;
    if (want <= 0 || tasks <= grain || atomic_flag_test_and_set(&team.busy)) {
        fn(ctx, 0, tasks);
        return;
    }
    if (!team.fork_handler) team.fork_handler = !pthread_atfork(NULL, NULL, team_after_fork);
    while (team.helpers < want) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper_main, (void *)(intptr_t)team.helpers)) break;
        pthread_detach(t);
        team.helpers++;
    }
    team.fn = fn;
    team.ctx = ctx;
    team.tasks = tasks;
    team.grain = grain;
    team.wanted = want;
    atomic_store(&team.next, 0);
    atomic_fetch_add(&team.gen, 1);
    atomic_store(&team.open, 1);
    if (atomic_load(&team.sleeping)) {
        pthread_mutex_lock(&team.lock);
        pthread_cond_broadcast(&team.wake);
        pthread_mutex_unlock(&team.lock);
    }
    claim_tasks(0);
    atomic_store(&team.open, 0);
    while (atomic_load(&team.active)) cpu_relax();
    atomic_flag_clear(&team.busy);
}

/* the same on OpenMP's team of the calling thread */
static void omp_for(task_fn fn, void *ctx, int64_t tasks, int64_t grain, int threads) {
    _Atomic int64_t next = 0;
#pragma omp parallel num_threads(threads)
    {
        int helper = omp_get_thread_num() != 0;
        for (;;) {
            int64_t b = atomic_fetch_add(&next, grain);
            if (b >= tasks) break;
            if (helper) atomic_fetch_add(&team.helped, 1);
            fn(ctx, b, b + grain < tasks ? b + grain : tasks);
        }
    }
}

/* fn(ctx, begin, end) over tasks 0..tasks-1, `grain` at a time, on up to `threads` threads: on the
 * helper team if `own` (the products, the fused step's attention), else on OpenMP's */
static void parallel_for(task_fn fn, void *ctx, int64_t tasks, int64_t grain, int64_t threads, int own) {
    int64_t grains = (tasks + grain - 1) / grain;
    int64_t useful = threads < grains ? threads : grains;
    if (useful <= 1)
        fn(ctx, 0, tasks);
    else if (own)
        team_for(fn, ctx, tasks, grain, useful);
    else
        omp_for(fn, ctx, tasks, grain, (int)useful);
}

int64_t ct_helper_grains(void) { return atomic_load(&team.helped); }

/* Rows a thread of a norm or SiLU x up claims at a time: a decode step's few rows stay on one thread, a
 * prefill chunk's split (one row is ~1-3 us; these took ~11% of a 2048-token prefill on one thread) */
#define ROW_GRAIN 16

/* Rows up to which a product, norm or SiLU x up called between ops runs on the helper team rather than
 * OpenMP's: a decode-sized step's (its C calls all run there). Mixing teams leaves one's idle thread
 * spinning on the core the other's thread needs: a norm on OpenMP's before the lm_head's product on the
 * helpers took 32 coroutines' head 9.0 -> 5.9 ms (2-core Zen 4, SmolLM2 int8). A prefill chunk's, between
 * torch's ops (OpenMP's), stay on OpenMP's. */
#define HELPER_TEAM_ROWS 32

/* The norm (norm_rows) of rows over up to `threads` threads (a call between other ops: the team as
 * HELPER_TEAM_ROWS says), each row whole on one thread: the same result at any thread count. */
void ct_rms_norm(const void *x, int64_t xs, const void *res, int64_t rs, void *sum_out, const void *w,
                 void *out, int64_t rows, int64_t dim, float eps, int zero_centred, int bf, int64_t threads) {
    NormJob j = {x, res, w, sum_out, out, xs, rs, dim, eps, zero_centred, bf};
    parallel_for(norm_rows, &j, rows, ROW_GRAIN, threads, rows <= HELPER_TEAM_ROWS);
}

/* silu_rows over up to `threads` threads, as ct_rms_norm */
void ct_silu_mul(const void *gate_up, int64_t gs, void *out, int64_t rows, int64_t inter, int bf, int64_t threads) {
    SiluJob j = {gate_up, out, gs, inter, bf};
    parallel_for(silu_rows, &j, rows, ROW_GRAIN, threads, rows <= HELPER_TEAM_ROWS);
}

/* Rotate this step's keys k [T, H, D] (row stride ks) with per-row tables cos/sin [T, rot] and write
 * them, with the values v [T, H, D] (row stride vs), to pool slots slots[t] of one layer's
 * pool_k/pool_v [S, H, D]; tokens over up to `threads` threads (the team as HELPER_TEAM_ROWS says),
 * each key rounded and stored as one row (a 512-token prefill chunk's keys took SmolLM2 ~0.4 ms a
 * layer one element at a time on one thread). */
typedef struct {
    const void *k, *v, *cos, *sin;
    int64_t ks, vs, heads, d, rot;
    const int64_t *slots;
    void *pool_k, *pool_v;
    int bf;
} StoreJob;

static void store_rows(void *ctx, int64_t begin, int64_t end) {
    const StoreJob *j = ctx;
    int64_t size = j->bf ? 2 : 4, heads = j->heads, d = j->d, rot = j->rot;
    float *x = malloc((size_t)d * sizeof(float)), *y = malloc((size_t)d * sizeof(float));
    for (int64_t t = begin; t < end; t++) {
        int64_t slot = j->slots[t];
        const char *c = (const char *)j->cos + t * rot * size, *s = (const char *)j->sin + t * rot * size;
        for (int64_t h = 0; h < heads; h++) {
            load_row((const char *)j->k + (t * j->ks + h * d) * size, d, j->bf, x);
            rotate(x, d, rot, c, s, j->bf, y);
            store_row((char *)j->pool_k + (slot * heads + h) * d * size, y, d, j->bf);
        }
        memcpy((char *)j->pool_v + slot * heads * d * size, (const char *)j->v + t * j->vs * size,
               (size_t)(heads * d * size));
    }
    free(x);
    free(y);
}

void ct_store_kv(const void *k, int64_t ks, const void *v, int64_t vs, const int64_t *slots, int64_t t_rows,
                 int64_t heads, int64_t d, int64_t rot, const void *cos, const void *sin, void *pool_k,
                 void *pool_v, int bf, int64_t threads) {
    StoreJob j = {k, v, cos, sin, ks, vs, heads, d, rot, slots, pool_k, pool_v, bf};
    parallel_for(store_rows, &j, t_rows, ROW_GRAIN, threads, t_rows <= HELPER_TEAM_ROWS);
}

/* Eight float32 lanes (GCC/Clang vector extensions: AVX on x86, NEON pairs on Arm, plain code
 * elsewhere). Loads and stores go through memcpy: nothing needs to be aligned. */
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t w8 __attribute__((vector_size(32)));

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ld16x reads bfloat16 pairs as little-endian words"
#endif

static inline v8 ld8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* Elements i .. i+15 of a float32 (bf 0) or bfloat16 (bf 1) row as two float32 vectors: for float32
 * the two halves, for bfloat16 the even and the odd elements (one load and two integer ops, no lane
 * shuffles). `deal` puts float32 rows that meet these in the same order. */
static inline void ld16x(const void *p, int64_t i, int bf, v8 *lo, v8 *hi) {
    if (!bf) {
        *lo = ld8((const float *)p + i);
        *hi = ld8((const float *)p + i + 8);
        return;
    }
    w8 w, even, odd;
    memcpy(&w, (const bf16 *)p + i, sizeof w);
    even = w << 16;
    odd = w & 0xffff0000u;
    memcpy(lo, &even, sizeof *lo);
    memcpy(hi, &odd, sizeof *hi);
}

/* x[n] (n a multiple of 16) from natural order into ld16x's order for bf (back with `inverse`) */
static void deal(float *x, int64_t n, int bf, int inverse) {
    if (!bf) return;
    float t[16];
    for (int64_t b = 0; b < n; b += 16) {
        memcpy(t, x + b, sizeof t);
        for (int u = 0; u < 8; u++) {
            if (inverse) {
                x[b + 2 * u] = t[u];
                x[b + 2 * u + 1] = t[u + 8];
            } else {
                x[b + u] = t[2 * u];
                x[b + u + 8] = t[2 * u + 1];
            }
        }
    }
}

static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

/* The lane sums of a[0..7] as one vector (a transpose folded into the adds): lane u is hsum8(a[u]),
 * to the bit. */
static inline v8 sum8x8(const v8 *a) {
    v8 b[4], c[2];
    for (int u = 0; u < 4; u++) /* lane pairs (i, i+4) of a[2u] and a[2u+1], interleaved */
        b[u] = __builtin_shufflevector(a[2 * u], a[2 * u + 1], 0, 8, 1, 9, 2, 10, 3, 11)
             + __builtin_shufflevector(a[2 * u], a[2 * u + 1], 4, 12, 5, 13, 6, 14, 7, 15);
    for (int u = 0; u < 2; u++)
        c[u] = __builtin_shufflevector(b[2 * u], b[2 * u + 1], 0, 1, 8, 9, 2, 3, 10, 11)
             + __builtin_shufflevector(b[2 * u], b[2 * u + 1], 4, 5, 12, 13, 6, 7, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* q . k for 16-channel blocks of q (float32, ld16x's order) and one key row */
static inline v8 dot_lanes(const float *q, const void *k, int64_t d, int bf) {
    v8 a = {0}, k0, k1;
    for (int64_t e = 0; e < d; e += 16) {
        ld16x(k, e, bf, &k0, &k1);
        a += ld8(q + e) * k0;
        a += ld8(q + e + 8) * k1;
    }
    return a;
}

/* Keys per pass of the online softmax (the score buffer's width). */
#define CHUNK 64

/* One pass of an online softmax over c <= CHUNK keys for the g query heads of one key head, read in
 * place from the pool (k[x], v[x]: row pointers; d a multiple of 16): qr [g, d] rotated float32
 * queries, running max m, sum l and unnormalised output acc [g, d], both in ld16x's order. Inlined
 * per dtype (bf a constant). */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *qr, const char *const *k, const char *const *v, int64_t c, int64_t g, int64_t d, float scale,
    float *scores, float *m, float *l, float *acc, int bf) {
    for (int64_t j = 0; j < g; j++) {
        const float *qj = qr + j * d;
        float *sj = scores + j * CHUNK;
        int64_t x = 0;
        for (; x + 8 <= c; x += 8) { /* eight keys at once: one vector of scores, no per-key lane sum */
            v8 a[8];
            for (int u = 0; u < 8; u++) a[u] = dot_lanes(qj, k[x + u], d, bf);
            st8(sj + x, sum8x8(a) * scale);
        }
        for (; x < c; x++) sj[x] = hsum8(dot_lanes(qj, k[x], d, bf)) * scale;
        float top = m[j];
        for (x = 0; x < c; x++) top = sj[x] > top ? sj[x] : top;
        float rescale = fast_exp(m[j] - top); /* 0 on the first pass (m = -inf) */
        m[j] = top;
        for (x = 0; x < c; x++) sj[x] = fast_exp(sj[x] - top);
        l[j] = l[j] * rescale + sum(sj, c);
        float *o = acc + j * d;
        int64_t e = 0;
        for (; e + 64 <= d; e += 64) { /* 64 output lanes in registers: eight independent add chains */
            v8 y[8], v0, v1;
            for (int u = 0; u < 8; u++) y[u] = ld8(o + e + 8 * u) * rescale;
            for (x = 0; x < c; x++)
                for (int u = 0; u < 4; u++) {
                    ld16x(v[x], e + 16 * u, bf, &v0, &v1);
                    y[2 * u] += sj[x] * v0;
                    y[2 * u + 1] += sj[x] * v1;
                }
            for (int u = 0; u < 8; u++) st8(o + e + 8 * u, y[u]);
        }
        for (; e < d; e += 16) {
            v8 y0 = ld8(o + e) * rescale, y1 = ld8(o + e + 8) * rescale, v0, v1;
            for (x = 0; x < c; x++) {
                ld16x(v[x], e, bf, &v0, &v1);
                y0 += sj[x] * v0;
                y1 += sj[x] * v1;
            }
            st8(o + e, y0);
            st8(o + e + 8, y1);
        }
    }
}

/* Prefetch (into L2) the `bytes` from p, a line at a time. The decode attention's keys and values come
 * from memory: a step's weights pass through the caches between two steps' reads of them. Requested
 * a chunk's rows at once rather than each as its turn comes, their latencies overlap. On a 2-core Zen 4
 * (SmolLM2, ad hoc: the fused decode layers with and without, alternating step by step in one process,
 * medians of 3-6 runs): 32 bfloat16 coroutines over a 256-token context and up to 64 tokens of their
 * own, their own runs 1.16x, the shared run's blocks 1.14x, the layers 1.02x; one stream over 256 and
 * 2000 keys, the layers 1.04x and 1.12x (float32 1.03x and 1.13x). Prefetching the shared run's next
 * chunk rather than this one's gained nothing. */
static inline void prefetch_lines(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

/* The arguments of ct_decode_attention, for its items split over threads. */
typedef struct {
    const void *q;
    int64_t qs, qh, hq, hkv, d, rot;
    const int64_t *rows, *run_start, *key_start, *slots;
    const void *cos, *sin, *pool_k, *pool_v;
    float scale;
    float *out;
    int bf;
    const int64_t *shared_of; /* per run: its reader index in `partial` where a shared run's was computed, else -1 */
    const float *partial;     /* per reader: m [hq], l [hq], acc [hq, d] (shared_tasks), or NULL */
    int64_t split;            /* tasks per item: 1, or hkv (one per key head: fewer items than threads) */
} AttentionJob;

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define ATTEND_BF16_PAIRS 1
/* How fold16x16 combines lanes: float sums, float maxima, or int32 sums of the lanes' bit patterns */
enum { FOLD_ADD, FOLD_MAX, FOLD_ADD_I32 };
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) v16 fold(v16 x, v16 y, const int op) {
    return op == FOLD_ADD ? x + y : op == FOLD_MAX ? (v16)_mm512_max_ps((__m512)x, (__m512)y) : (v16)((v16i)x + (v16i)y);
}

/* lane u of the result: a[u]'s 16 lanes combined by `op` (a 16 x 16 transpose folded into the combines) */
static inline __attribute__((always_inline)) v16 fold16x16(const v16 *a, const int op) {
    v16 b[8], c[4], e[2];
    for (int u = 0; u < 8; u++) /* lanes i and i + 8 of a[2u], a[2u + 1]: interleaved */
        b[u] = fold(__builtin_shufflevector(a[2 * u], a[2 * u + 1], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                    __builtin_shufflevector(a[2 * u], a[2 * u + 1], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                    op);
    for (int u = 0; u < 4; u++)
        c[u] = fold(__builtin_shufflevector(b[2 * u], b[2 * u + 1], 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23),
                    __builtin_shufflevector(b[2 * u], b[2 * u + 1], 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31),
                    op);
    for (int u = 0; u < 2; u++)
        e[u] = fold(__builtin_shufflevector(c[2 * u], c[2 * u + 1], 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                    __builtin_shufflevector(c[2 * u], c[2 * u + 1], 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31),
                    op);
    return fold(__builtin_shufflevector(e[0], e[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                __builtin_shufflevector(e[0], e[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31), op);
}

/* fast_exp on 16 lanes: the same reduction and polynomial with fused multiply-adds (16 vector
   operations, where fast_exp's separate roundings took 25: the softmaxes' largest cost after the dot
   products), 2^n by VSCALEFPS; within float32 rounding of fast_exp, not its bits */
static inline __m512 exp16(__m512 x) {
    __m512 z = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), z);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512 y = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

/* 32 channels e .. e + 31 of a bfloat16 row, or the 16 left at its end (zeros after) */
static inline __m512bh ld_pairs(const bf16 *p, int64_t e, int64_t d) {
    return (__m512bh)(e + 32 <= d ? _mm512_loadu_si512(p + e) : _mm512_maskz_loadu_epi16(0xFFFF, p + e));
}

/* q . k[u] over d (a multiple of 16) for NK keys (a constant after inlining) as 16 lanes of partial
   sums each: bfloat16 pairs by VDPBF16PS (the products exact in float32: the rotated query holds
   bfloat16 values), one accumulator per key */
static inline __attribute__((always_inline)) void dot_pairs(const bf16 *q, const char *const *k, int64_t d,
                                                            v16 *a, const int nk) {
    for (int u = 0; u < nk; u++) a[u] = (v16)_mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 32) {
        __m512bh qe = ld_pairs(q, e, d);
        for (int u = 0; u < nk; u++)
            a[u] = (v16)_mm512_dpbf16_ps((__m512)a[u], ld_pairs((const bf16 *)k[u], e, d), qe);
    }
}

/* the first n of 16 lanes (none for n <= 0, all for n >= 16) */
static inline __mmask16 lanes_below(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1u));
}

/* 16 bfloat16 widened exactly */
static inline __m512 widen16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* channels e .. e + 16 NE of NH (constants after inlining) heads' outputs o [NH, d]: o * rescale +
   sum_x p[x] v[x], each value vector widened once for the NH heads */
static inline __attribute__((always_inline)) void pv_block(float *o, const float *p, const float *rescale,
                                                           const char *const *v, int64_t c, int64_t d, int64_t e,
                                                           const int nh, const int ne) {
    __m512 y[4][4];
    for (int j = 0; j < nh; j++)
        for (int u = 0; u < ne; u++)
            y[j][u] = _mm512_mul_ps(_mm512_loadu_ps(o + j * d + e + 16 * u), _mm512_set1_ps(rescale[j]));
    for (int64_t x = 0; x < c; x++) {
        __m512 vv[4];
        for (int u = 0; u < ne; u++) vv[u] = widen16((const bf16 *)v[x] + e + 16 * u);
        for (int j = 0; j < nh; j++) {
            __m512 px = _mm512_set1_ps(p[j * CHUNK + x]);
            for (int u = 0; u < ne; u++) y[j][u] = _mm512_fmadd_ps(px, vv[u], y[j][u]);
        }
    }
    for (int j = 0; j < nh; j++)
        for (int u = 0; u < ne; u++) _mm512_storeu_ps(o + j * d + e + 16 * u, y[j][u]);
}

/* The online softmax of one row's chunk of CHUNK dot products sj, the first c of them seen (1 <= c): in
   place p = exp(s scale - max) for those, 0 for the rest of the chunk; the row's running max m and
   sum l updated; returns the rescale of what came before (0 on the first chunk, m = -inf). The
   decode attention's per head, the shared runs' and the prefill's per query row. */
static inline float softmax_chunk(float *sj, int64_t c, float scale, float *m, float *l) {
    __m512 k = _mm512_set1_ps(scale), top16 = _mm512_set1_ps(*m), sum16 = _mm512_setzero_ps();
    for (int64_t x = 0; x < c; x += 16) {
        __mmask16 in = lanes_below(c - x);
        top16 = _mm512_mask_max_ps(top16, in, top16, _mm512_mul_ps(_mm512_maskz_loadu_ps(in, sj + x), k));
    }
    float top = _mm512_reduce_max_ps(top16);
    float rescale = fast_exp(*m - top);
    *m = top;
    for (int64_t x = 0; x < CHUNK; x += 16) {
        __mmask16 in = lanes_below(c - x);
        __m512 p = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(sj + x), k),
                                                               _mm512_set1_ps(top))));
        _mm512_storeu_ps(sj + x, p);
        sum16 = _mm512_add_ps(sum16, p);
    }
    *l = *l * rescale + _mm512_reduce_add_ps(sum16);
    return rescale;
}

/* o <- o rescale + P V for n rows of o [n, d] (p: row j at p + j * CHUNK, rescale[j]) over a chunk's
   c values v[x]: up to four rows per widened value */
static inline void pv_rows(float *o, const float *p, const float *rescale, const char *const *v, int64_t c,
                           int64_t d, int64_t n) {
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        int64_t nh = n - j0 < 4 ? n - j0 : 4, e = 0;
#define PV_BLOCK(NH, NE) pv_block(o + j0 * d, p + j0 * CHUNK, rescale + j0, v, c, d, e, NH, NE)
        for (; e + 64 <= d; e += 64)
            switch (nh) { case 4: PV_BLOCK(4, 4); break; case 3: PV_BLOCK(3, 4); break;
                          case 2: PV_BLOCK(2, 4); break; default: PV_BLOCK(1, 4); }
        for (; e < d; e += 16)
            switch (nh) { case 4: PV_BLOCK(4, 1); break; case 3: PV_BLOCK(3, 1); break;
                          case 2: PV_BLOCK(2, 1); break; default: PV_BLOCK(1, 1); }
#undef PV_BLOCK
    }
}

/* attend_chunk for a bfloat16 pool on AVX-512 BF16, in natural channel order: scores by VDPBF16PS
 * (16 keys' lane sums at once), the online softmax on 16 lanes, P V in float32 with each value row
 * widened once for up to four query heads (attend_chunk widens it per head in 8-lane halves, and its
 * max and exponentials ran as scalar chains). Float32 sums throughout, within float32 rounding of the
 * reference as before. Measured on a 2-core Zen 4: 32 items over a 256-key shared run and 32 keys of
 * their own (SmolLM2's heads), one thread, 0.62-0.65 -> 0.39 ms per layer; 32 coroutines' bfloat16
 * decode 527-577 -> 620-632 tokens/s, one stream's +3%. */
static inline void attend_chunk_bf16(const bf16 *qb, const char *const *k, const char *const *v, int64_t c,
                                     int64_t g, int64_t d, float scale, float *scores, float *m, float *l,
                                     float *acc) {
    for (int64_t j = 0; j < g; j++) {
        const bf16 *qj = qb + j * d;
        float *sj = scores + j * CHUNK;
        int64_t x = 0;
        v16 a[16];
        for (; x + 16 <= c; x += 16) {
            dot_pairs(qj, k + x, d, a, 16);
            _mm512_storeu_ps(sj + x, (__m512)fold16x16(a, FOLD_ADD));
        }
        for (; x < c; x++) {
            dot_pairs(qj, k + x, d, a, 1);
            sj[x] = _mm512_reduce_add_ps((__m512)a[0]);
        }
        scores[CHUNK * g + j] = softmax_chunk(sj, c, scale, m + j, l + j);
    }
    pv_rows(acc, scores, scores + CHUNK * g, v, c, d, g);
}

#define CHUNK_VECS (CHUNK / 16) /* a row's scores of a chunk: 16-lane vectors */

/* scores s[i][0 .. CHUNK - 1] of NR (constant after inlining) query rows qr[i] (bfloat16 pairs)
   against the packed keys kp[p * CHUNK + c] */
static inline __attribute__((always_inline)) void score_rows(const uint32_t *const *qr, const uint32_t *kp,
                                                             int64_t pairs, float *s, const int nr) {
    __m512 acc[6][CHUNK_VECS];
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < CHUNK_VECS; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh kv[CHUNK_VECS];
        for (int u = 0; u < CHUNK_VECS; u++) kv[u] = (__m512bh)_mm512_loadu_si512(kp + p * CHUNK + 16 * u);
        for (int i = 0; i < nr; i++) {
            __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qr[i][p]);
            for (int u = 0; u < CHUNK_VECS; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], kv[u], qb);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < CHUNK_VECS; u++) _mm512_storeu_ps(s + i * CHUNK + 16 * u, acc[i][u]);
}

/* float32 scores s[i][0 .. CHUNK - 1] of NR (constant after inlining) query rows qr[i] against a block's
   keys packed per channel, kp[e * CHUNK + c]: per channel one FMA per row and 16 keys */
static inline __attribute__((always_inline)) void score_rows_f32(const float *const *qr, const float *kp, int64_t d,
                                                                 float *s, const int nr) {
    __m512 acc[6][CHUNK_VECS];
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < CHUNK_VECS; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e++) {
        __m512 kv[CHUNK_VECS];
        for (int u = 0; u < CHUNK_VECS; u++) kv[u] = _mm512_loadu_ps(kp + e * CHUNK + 16 * u);
        for (int i = 0; i < nr; i++) {
            __m512 qb = _mm512_set1_ps(qr[i][e]);
            for (int u = 0; u < CHUNK_VECS; u++) acc[i][u] = _mm512_fmadd_ps(kv[u], qb, acc[i][u]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < CHUNK_VECS; u++) _mm512_storeu_ps(s + i * CHUNK + 16 * u, acc[i][u]);
}

/* CALL(NR) for NR = n, 1 <= n <= 6, NR a constant in each call (the kernels' row counts unrolled) */
#define UP_TO_SIX(n, CALL)                                                                               \
    switch (n) {                                                                                         \
    case 6: CALL(6); break;                                                                              \
    case 5: CALL(5); break;                                                                              \
    case 4: CALL(4); break;                                                                              \
    case 3: CALL(3); break;                                                                              \
    case 2: CALL(2); break;                                                                              \
    default: CALL(1);                                                                                    \
    }

/* scores s[r][0 .. CHUNK - 1] of `rows` query rows q[r] against a chunk's packed keys kp, six rows per
   pass over the keys (24 accumulators): bfloat16 pairs (bf: `depth` pairs, kp[p * CHUNK + c]) or float32
   (`depth` channels, kp[e * CHUNK + c]) */
static void chunk_scores(const void *const *q, int64_t rows, const void *kp, int64_t depth, float *s, int bf) {
#define SCORE(NR) (bf ? score_rows((const uint32_t *const *)qr, kp, depth, sr, NR) \
                      : score_rows_f32((const float *const *)qr, kp, depth, sr, NR))
    for (int64_t r0 = 0; r0 < rows; r0 += 6) {
        const void *const *qr = q + r0;
        float *sr = s + r0 * CHUNK;
        UP_TO_SIX(rows - r0 < 6 ? rows - r0 : 6, SCORE)
    }
#undef SCORE
}

/* Shared runs (a block several items of a step read: a shared context): with bfloat16 pools, each
 * key head of such a run is attended once for all its readers' queries, before the items, rather than
 * once per reader, as the prefill kernel attends a chunk's rows over a block: per block of CHUNK keys
 * the keys packed in pairs along the lanes and the values in pairs of keys (`pack_shared_chunk`), the
 * scores of six query rows at a time by VDPBF16PS with no horizontal sums (chunk_scores), the online
 * softmax of every row (prefill_softmax: P rounded to bfloat16 for P V, as the prefill's and torch's
 * flash kernel round it) and P V by VDPBF16PS (block_values). Each reader's partial (its running max,
 * sum and unnormalised output per head) is merged into its item's softmax where the item meets the run
 * (`merge_partial`): the log-sum-exp merge. Against attending the run per item (float32 P V) each
 * output moves by at most 2^-9 max|v| plus float32 rounding. Measured on a 2-core Zen 4 (SmolLM2's
 * heads, 32 items over a 256-key run and 32 keys of their own, ms per layer, per item / shared with
 * float32 P V and packing key by key / this): 0.171 / 0.147 / 0.113; over 1024 keys 0.554 / 0.421 /
 * 0.280. Built with the prefill kernel's helpers (AVX-512 BF16 and VNNI: every CPU with the first). */
typedef struct {
    const AttentionJob *j;
    const int64_t *group_start, *group_runs, *run_item; /* readers of group G: runs group_runs[group_start[G] ..] */
    const int64_t (*tasks)[3];                          /* (group, key head, first reader); to the next */
    float *partial;                                     /* per reader: m [hq], l [hq], acc [hq, d] */
} SharedJob;

#define SHARED_READERS 16 /* readers per task: their query rows share one packing of the run's keys */

#if defined(__AVX512VNNI__)
#define SHARED_RUNS 1
static void prefill_softmax(float *s, const int64_t *visible, int64_t rows, float scale, float *m, float *l,
                            float *rescale, uint32_t *pb);
static void block_values(float *o, const void *p, const float *rescale, const void *v, int64_t vs, int64_t n,
                         int64_t d, int64_t rows, int bf);

/* VPERMT2W orders interleaving two vectors of 32 words a, b: a0 b0 a1 b1 .. a15 b15, then a16 b16 .. a31 b31 */
static const uint16_t WORD_PAIRS[2][32] = {
    {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
    {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};

/* r[i] <- column i of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15] */
static inline void transpose16x16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c], lane L: rows i .. i + 3 of column 4 L + c */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

/* A block of c <= CHUNK bfloat16 keys and values of d channels (rows kr[x], vr[x]) as the prefill
   kernel and the shared runs read it: the keys in pairs along the lanes, kp[p * CHUNK + x], and the
   values in pairs of keys, vp[x / 2 * d + e], zeros past c; 16 x 16 transposes of the keys' pairs and
   VPERMT2W interleaves of value rows (element by element the packing took as long as a shared chunk's
   scores) */
static void pack_block(const char *const *kr, const char *const *vr, int64_t c, int64_t d, uint32_t *kp,
                       uint32_t *vp) {
    int64_t pairs = d / 2;
    for (int64_t kb = 0; kb < CHUNK; kb += 16) {
        int64_t p0 = 0;
        for (; p0 + 16 <= pairs; p0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = kb + i < c ? _mm512_loadu_si512(kr[kb + i] + 4 * p0) : _mm512_setzero_si512();
            transpose16x16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(kp + (p0 + i) * CHUNK + kb, r[i]);
        }
        for (int64_t p = p0; p < pairs; p++)
            for (int64_t i = 0; i < 16; i++)
                kp[p * CHUNK + kb + i] = kb + i < c ? ((const uint32_t *)kr[kb + i])[p] : 0;
    }
    const __m512i lo = _mm512_loadu_si512(WORD_PAIRS[0]), hi = _mm512_loadu_si512(WORD_PAIRS[1]);
    for (int64_t x = 0; x < CHUNK; x += 2) {
        for (int64_t e = 0; e < d; e += 32) { /* channels e .. e + 31 of keys x, x + 1: 64 words */
            __mmask32 in = e + 32 <= d ? (__mmask32)~0u : (__mmask32)((1u << (d - e)) - 1u);
            __m512i v0 = x < c ? _mm512_maskz_loadu_epi16(in, vr[x] + 2 * e) : _mm512_setzero_si512();
            __m512i v1 = x + 1 < c ? _mm512_maskz_loadu_epi16(in, vr[x + 1] + 2 * e) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + x / 2 * d + e, _mm512_permutex2var_epi16(v0, lo, v1));
            if (e + 16 < d) _mm512_storeu_si512(vp + x / 2 * d + e + 16, _mm512_permutex2var_epi16(v0, hi, v1));
        }
    }
}

/* A shared run's keys a .. a + c - 1 (c <= CHUNK) of key head kh, read through their pool slots, packed
   (`pack_block`); their rows are prefetched first (prefetch_lines) */
static void pack_shared_chunk(const AttentionJob *j, int64_t a, int64_t c, int64_t kh, uint32_t *kp, uint32_t *vp) {
    int64_t row = (int64_t)sizeof(bf16) * j->d;
    const char *kr[CHUNK], *vr[CHUNK];
    for (int64_t x = 0; x < c; x++) {
        int64_t at = (j->slots[a + x] * j->hkv + kh) * row;
        kr[x] = (const char *)j->pool_k + at;
        vr[x] = (const char *)j->pool_v + at;
        prefetch_lines(kr[x], row);
        prefetch_lines(vr[x], row);
    }
    pack_block(kr, vr, c, j->d, kp, vp);
}
static void shared_tasks(void *ctx, int64_t begin, int64_t end) {
    const SharedJob *sj = ctx;
    const AttentionJob *j = sj->j;
    int64_t hq = j->hq, g = hq / j->hkv, d = j->d, size = 2, most = SHARED_READERS * g;
    bf16 *qb = malloc((size_t)(most * d) * sizeof(bf16));
    uint32_t *kp = malloc((size_t)(d / 2 * CHUNK) * sizeof(uint32_t));
    float *s = malloc((size_t)(most * CHUNK) * sizeof(float)), *acc = malloc((size_t)(most * d) * sizeof(float));
    float *m = malloc((size_t)most * sizeof(float)), *l = malloc((size_t)most * sizeof(float));
    float *rescale = malloc((size_t)most * sizeof(float));
    float *qf = malloc((size_t)d * sizeof(float)), *qr = malloc((size_t)d * sizeof(float));
    int64_t *visible = malloc((size_t)most * sizeof(int64_t));
    uint32_t *pb = malloc((size_t)(most * CHUNK / 2) * sizeof(uint32_t));
    uint32_t *vp = malloc((size_t)(CHUNK / 2 * d) * sizeof(uint32_t));
    for (int64_t t = begin; t < end; t++) {
        int64_t group = sj->tasks[t][0], kh = sj->tasks[t][1], first = sj->tasks[t][2];
        int64_t last = first + SHARED_READERS < sj->group_start[group + 1] ? first + SHARED_READERS
                                                                            : sj->group_start[group + 1];
        int64_t rows = (last - first) * g, run0 = sj->group_runs[sj->group_start[group]];
        const uint32_t *qrows[rows];
        for (int64_t r = 0; r < rows; r++) qrows[r] = (const uint32_t *)(qb + r * d);
        for (int64_t i = first; i < last; i++) { /* each reader's queries of this key head, rotated for the run */
            int64_t r = sj->group_runs[i];
            const char *qrow = (const char *)j->q + j->rows[sj->run_item[r]] * j->qs * size;
            for (int64_t h = 0; h < g; h++) {
                load_row(qrow + (kh * g + h) * j->qh * size, d, 1, qf);
                int64_t at = r * j->rot * size; /* the run's tables */
                rotate(qf, d, j->rot, (const char *)j->cos + at, (const char *)j->sin + at, 1, qr);
                for (int64_t e = 0; e < d; e++) qb[((i - first) * g + h) * d + e] = to_bf16(qr[e]); /* exact */
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        memset(acc, 0, (size_t)(rows * d) * sizeof(float));
        for (int64_t a = j->key_start[run0]; a < j->key_start[run0 + 1]; a += CHUNK) {
            int64_t c = j->key_start[run0 + 1] - a < CHUNK ? j->key_start[run0 + 1] - a : CHUNK;
            pack_shared_chunk(j, a, c, kh, kp, vp);
            chunk_scores((const void *const *)qrows, rows, kp, d / 2, s, 1);
            for (int64_t r = 0; r < rows; r++) visible[r] = c;
            prefill_softmax(s, visible, rows, j->scale, m, l, rescale, pb);
            block_values(acc, pb, rescale, vp, 0, c, d, rows, 1);
        }
        for (int64_t i = first; i < last; i++) { /* the readers' partials, head by head */
            float *part = sj->partial + i * hq * (d + 2);
            for (int64_t h = 0; h < g; h++) {
                int64_t row = (i - first) * g + h, head = kh * g + h;
                part[head] = m[row];
                part[hq + head] = l[row];
                memcpy(part + 2 * hq + head * d, acc + row * d, (size_t)d * sizeof(float));
            }
        }
    }
    free(qb);
    free(kp);
    free(s);
    free(acc);
    free(m);
    free(l);
    free(rescale);
    free(qf);
    free(qr);
    free(visible);
    free(pb);
    free(vp);
}
#else
#define SHARED_RUNS 0
#endif /* __AVX512VNNI__ */

#else
#define ATTEND_BF16_PAIRS 0
#define SHARED_RUNS 0
#endif

/* a shared run's partial (shared_tasks) merged into an item's online softmax state m, l, acc [hq, d] */
static void merge_partial(const float *part, int64_t hq, int64_t d, int64_t h0, int64_t h1, float *m, float *l,
                          float *acc) {
    for (int64_t h = h0; h < h1; h++) {
        float pm = part[h], top = m[h] > pm ? m[h] : pm;
        float a = fast_exp(m[h] - top), b = fast_exp(pm - top); /* a = 0 while the item has seen no key */
        for (int64_t e = 0; e < d; e++) acc[h * d + e] = acc[h * d + e] * a + part[2 * hq + h * d + e] * b;
        l[h] = l[h] * a + part[hq + h] * b;
        m[h] = top;
    }
}

/* Item i of an AttentionJob: the query heads of key heads kh0 .. kh1-1 over its runs (the query rotated
 * per run) into its row of out, with the scratch of the thread that runs it; bf a constant. A pass reads
 * the chunk's keys of those key heads, so each slot's rows are read together (adjacent lines). A run
 * whose partial the shared phase computed (j->shared_of) is merged instead. Heads are independent: a
 * head's result does not depend on which others a task takes. */
static inline __attribute__((always_inline)) void attention_item(const AttentionJob *j, int64_t i, int64_t kh0,
                                                                  int64_t kh1, float *qf, float *qr, bf16 *qb,
                                                                  float *scores, float *acc, float *m, float *l,
                                                                  int bf) {
    int64_t hq = j->hq, hkv = j->hkv, d = j->d, rot = j->rot, g = hq / hkv, size = bf ? 2 : 4;
    int64_t h0 = kh0 * g, h1 = kh1 * g;
    int pairs = bf && ATTEND_BF16_PAIRS; /* natural channel order, the query in bfloat16 (qb) */
    const char *qrow = (const char *)j->q + j->rows[i] * j->qs * size, *cos = j->cos, *sin = j->sin;
    const char *pool_k = j->pool_k, *pool_v = j->pool_v;
    const int64_t *key_start = j->key_start, *slots = j->slots;
    float *out = j->out + j->rows[i] * hq * d;
    const char *k[CHUNK], *v[CHUNK];
    for (int64_t h = h0; h < h1; h++) {
        load_row(qrow + h * j->qh * size, d, bf, qf + h * d);
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc + h0 * d, 0, (size_t)((h1 - h0) * d) * sizeof(float));
    for (int64_t r = j->run_start[i]; r < j->run_start[i + 1]; r++) {
        if (j->partial && j->shared_of[r] >= 0) {
            merge_partial(j->partial + j->shared_of[r] * hq * (d + 2), hq, d, h0, h1, m, l, acc);
            continue;
        }
        for (int64_t h = h0; h < h1; h++) {
            rotate(qf + h * d, d, rot, cos + r * rot * size, sin + r * rot * size, bf, qr + h * d);
            if (pairs) /* exact: rotate rounds to bfloat16 */
                for (int64_t e = 0; e < d; e++) qb[h * d + e] = to_bf16(qr[h * d + e]);
            else
                deal(qr + h * d, d, bf, 0);
        }
        for (int64_t a = key_start[r]; a < key_start[r + 1]; a += CHUNK) {
            int64_t c = key_start[r + 1] - a < CHUNK ? key_start[r + 1] - a : CHUNK;
            for (int64_t x = 0; x < c; x++) { /* the chunk's rows of these key heads, requested together */
                int64_t at = (slots[a + x] * hkv + kh0) * d * size;
                prefetch_lines(pool_k + at, (kh1 - kh0) * d * size);
                prefetch_lines(pool_v + at, (kh1 - kh0) * d * size);
            }
            for (int64_t kh = kh0; kh < kh1; kh++) {
                for (int64_t x = 0; x < c; x++) {
                    int64_t at = (slots[a + x] * hkv + kh) * d * size;
                    k[x] = pool_k + at;
                    v[x] = pool_v + at;
                }
#if ATTEND_BF16_PAIRS
                if (pairs) {
                    attend_chunk_bf16(qb + kh * g * d, k, v, c, g, d, j->scale, scores, m + kh * g, l + kh * g,
                                      acc + kh * g * d);
                    continue;
                }
#endif
                attend_chunk(qr + kh * g * d, k, v, c, g, d, j->scale, scores, m + kh * g, l + kh * g,
                             acc + kh * g * d, bf);
            }
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        if (!pairs) deal(acc + h * d, d, bf, 1);
        for (int64_t e = 0; e < d; e++) out[h * d + e] = acc[h * d + e] / l[h];
    }
}

/* tasks begin .. end-1 of an AttentionJob: task t is item t / split, its key heads' share t % split */
static void attention_items(void *ctx, int64_t begin, int64_t end) {
    const AttentionJob *j = ctx;
    size_t heads = (size_t)j->hq, row = (size_t)(j->hq * j->d) * sizeof(float);
    float *qf = malloc(row), *qr = malloc(row), *acc = malloc(row);
    bf16 *qb = malloc((size_t)(j->hq * j->d) * sizeof(bf16));
    float *scores = malloc((size_t)(j->hq / j->hkv * (CHUNK + 1)) * sizeof(float)); /* + the rescales */
    float *m = malloc(heads * sizeof(float)), *l = malloc(heads * sizeof(float));
    int64_t share = j->hkv / j->split;
    for (int64_t t = begin; t < end; t++) {
        int64_t i = t / j->split, kh0 = t % j->split * share;
        if (j->bf)
            attention_item(j, i, kh0, kh0 + share, qf, qr, qb, scores, acc, m, l, 1);
        else
            attention_item(j, i, kh0, kh0 + share, qf, qr, qb, scores, acc, m, l, 0);
    }
    free(qb);
    free(m);
    free(l);
    free(qf);
    free(qr);
    free(acc);
    free(scores);
}

/* Attention of single-query items over their views, one call for all of them (items split over
 * up to `threads` threads).
 *
 * Item i's query is row rows[i] of q [T, Hq, D] (row stride qs, head stride qh). It reads the key
 * runs run_start[i] .. run_start[i+1]-1; run r is the pool slots slots[key_start[r] .. key_start[r+1])
 * and rotates the query with its own tables cos/sin [R, rot] (the query's position relative to the
 * run's block; keys carry block-local RoPE). All runs of an item form one softmax, which is what the
 * log-sum-exp merge of per-run partials computes (here online, CHUNK keys at a time). out [T, Hq, D]
 * float32, row rows[i] written. D is a multiple of 16 (Python checks). */
/* The decode attention on the helper team (`own`: inside a fused step) or on OpenMP's (between torch's
   ops) */
static void decode_attention(const void *q, int64_t qs, int64_t qh, int64_t hq, int64_t hkv, int64_t d,
                             int64_t rot, int64_t items, const int64_t *rows, const int64_t *run_start,
                             const int64_t *key_start, const int64_t *slots, const void *cos, const void *sin,
                             int64_t groups, const int64_t *group_start, const int64_t *group_runs,
                             const int64_t *shared_of, const void *pool_k, const void *pool_v, float scale,
                             float *out, int bf, int64_t threads, int own) {
    /* fewer items than threads (one stream's decode): a task per item and key head, so every thread helps
       (one item, SmolLM2's 9 query and 3 key heads, two Zen 4 threads: 300 keys 15.1 -> 12.2-12.8 us a
       call, 4 000 keys 139-142 -> 98-99 us) */
    int64_t split = items < threads ? hkv : 1;
    AttentionJob job = {q, qs, qh, hq, hkv, d, rot, rows, run_start, key_start, slots, cos, sin, pool_k,
                        pool_v, scale, out, bf, shared_of, NULL, split};
#if SHARED_RUNS
    if (bf && groups > 0) { /* the shared runs first, once per key head and block of readers */
        int64_t runs = run_start[items], readers = group_start[groups], count = 0;
        int64_t *run_item = malloc((size_t)runs * sizeof(int64_t));
        for (int64_t i = 0; i < items; i++)
            for (int64_t r = run_start[i]; r < run_start[i + 1]; r++) run_item[r] = i;
        int64_t (*tasks)[3] = malloc((size_t)(hkv * (readers + groups)) * sizeof *tasks);
        for (int64_t G = 0; G < groups; G++)
            for (int64_t kh = 0; kh < hkv; kh++)
                for (int64_t first = group_start[G]; first < group_start[G + 1]; first += SHARED_READERS) {
                    tasks[count][0] = G;
                    tasks[count][1] = kh;
                    tasks[count++][2] = first;
                }
        float *partial = malloc((size_t)(readers * hq * (d + 2)) * sizeof(float));
        SharedJob shared = {&job, group_start, group_runs, run_item, (const int64_t(*)[3])tasks, partial};
        parallel_for(shared_tasks, &shared, count, 1, threads, own);
        job.partial = partial;
        parallel_for(attention_items, &job, items * split, 1, threads, own);
        free(partial);
        free(tasks);
        free(run_item);
        return;
    }
#else
    (void)groups, (void)group_start, (void)group_runs;
#endif
    parallel_for(attention_items, &job, items * split, 1, threads, own);
}

void ct_decode_attention(const void *q, int64_t qs, int64_t qh, int64_t hq, int64_t hkv, int64_t d,
                         int64_t rot, int64_t items, const int64_t *rows, const int64_t *run_start,
                         const int64_t *key_start, const int64_t *slots, const void *cos, const void *sin,
                         int64_t groups, const int64_t *group_start, const int64_t *group_runs,
                         const int64_t *shared_of, const void *pool_k, const void *pool_v, float scale, float *out,
                         int bf, int64_t threads) {
    decode_attention(q, qs, qh, hq, hkv, d, rot, items, rows, run_start, key_start, slots, cos, sin, groups,
                     group_start, group_runs, shared_of, pool_k, pool_v, scale, out, bf, threads, 0);
}

/* Rows of a linear layer processed per pass over the weight: their accumulators stay in registers. */
#define LINEAR_GROUP 8
/* Bytes ahead of a weight stream that each cache line is prefetched: the loads of the rows in flight
 * are too few for the memory's latency (the loop's arithmetic fills the reorder window). Measured on
 * 2 threads, SmolLM2 single-stream decode (bench/step_phases.py): the portable kernel on Zen 3, the
 * fused layers 13.3 -> 12.0 ms per token in bfloat16 (float32 ran slower with it, int8 was bound by
 * widening: it prefetches bfloat16 only); the AVX-512 kernel on an Intel Xeon with AMX, int8 11.6 ->
 * 9.1-9.8 ms (63.7 -> 75-80 tokens/s), float32 unchanged (25.8 -> 25.5 ms): it prefetches every type. */
#define LINEAR_PREFETCH 2048
/* The tiled kernels (float32 tiles, bfloat16 / int8 / 4-bit pairs) prefetch their weight stream this
 * many bytes ahead into L2 (prefetcht1) rather than LINEAR_PREFETCH ahead into L1: a decode step's
 * products are latency-bound on the stream (the 4-bit kernel's loads stall on memory with L1
 * prefetches half as far ahead), and L2 holds more lines in flight. Measured on a 2-core Zen 4, one
 * process alternating the variants (a SmolLM2 decode's 120 layer products, median of 15-40 rounds):
 * 1 row 4-bit 4.07 -> 3.63 ms, int8 6.88 -> 6.07, bfloat16 10.40 -> 9.14, float32 18.65 -> 17.20;
 * 8 rows 4-bit 6.36 -> 5.98; 32 rows int8 17.27 -> 16.13, 4-bit 15.70 -> 15.31, bfloat16 and
 * float32 level. Into L1 at this distance: no gain (float32 18.52, 4-bit as before); into L2 at 8192
 * bytes: about the same as 4096. */
#define WEIGHT_PREFETCH 4096
#define prefetch_weight(p) __builtin_prefetch((const char *)(p) + WEIGHT_PREFETCH, 0, 2)

/* Weight storage of ct_linear: the model dtype (x's: float32 or bfloat16), int8 with a bfloat16
 * scale per output row (weight-only quantization, models/quantize.py), 4-bit groups (WT_Q4, below;
 * models/quant4.py), or in pairs (where the CPU has AVX-512 BF16, below): bfloat16 (WT_BF16P), int8
 * (WT_INT8P) or 4-bit (WT_Q4P, or WT_Q4PH: the same with half-precision scales and offsets); or float32
 * in tiles (WT_F32T, where the CPU has AVX-512, below). */
enum { WT_F32 = 0, WT_BF16 = 1, WT_INT8 = 2, WT_Q4 = 3, WT_BF16P = 4, WT_INT8P = 5, WT_Q4P = 6, WT_Q4PH = 7,
       WT_F32T = 8 };
#define WT_Q4_PAIRS(wt) ((wt) == WT_Q4P || (wt) == WT_Q4PH)
/* Outputs of a tile of the tiled layouts (WT_F32T, WT_BF16P, WT_INT8P, WT_Q4P(H)): two 16-lane vectors */
#define PAIR_TILE 32
/* Rows of x one pass over a WT_F32T or WT_BF16P tile takes (f32_tile, pairs_tile): 24 accumulators of the
 * 32 vector registers. Against 8 rows (LINEAR_GROUP) on a 2-core Zen 4, SmolLM2's products
 * (bench/linears.py, alternating builds, twice): float32 at 32 rows 50.5 / 49.9 against 53.9 / 54.0 ms,
 * bfloat16 pairs at 16 rows 16.2 / 15.8 against 17.5 / 18.0, at 32 28.4 / 29.2 against 29.4 / 30.9; 8
 * rows and 512 level. (The int8 and 4-bit tiles keep 8: their passes hold more registers.) */
#define TILE_ROWS 12

/* bytes of one weight row of k elements (the tiled layouts: of PAIR_TILE rows, per row) */
static inline int64_t weight_row_bytes(int wt, int64_t k) {
    return wt == WT_F32 || wt == WT_F32T ? 4 * k
         : (wt == WT_BF16 || wt == WT_BF16P ? 2 * k : (wt == WT_INT8 || wt == WT_INT8P ? k : k / 2));
}

/* Eight int8 as float32 (exact). GCC lowers a vector conversion from int8 to scalar code, so x86 with
 * AVX2 takes the two instructions it has for it (sign-extend, convert). */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 widen_i8(const int8_t *p) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
#else
typedef int8_t c8 __attribute__((vector_size(8)));
static inline v8 widen_i8(const int8_t *p) {
    c8 a;
    memcpy(&a, p, sizeof a);
    return __builtin_convertvector(a, v8);
}
#endif

/* Elements i .. i+15 of a weight row of type wt as two float32 vectors, in ld16x's order for
 * float32 and bfloat16 and in natural order for int8 (widened exactly: an int8 is a float32). */
static inline void ld16w(const void *p, int64_t i, int wt, v8 *lo, v8 *hi) {
    if (wt != WT_INT8) {
        ld16x(p, i, wt == WT_BF16, lo, hi);
        return;
    }
    *lo = widen_i8((const int8_t *)p + i);
    *hi = widen_i8((const int8_t *)p + i + 8);
}

/* One output of a linear after its float32 sum: int8's row scale (the sum times it, rounded to bfloat16),
 * the bias, the rounding to the model dtype (y_f32: float32 holding the rounded value) */
static inline void linear_out(float v, int64_t r, const bf16 *scale, const void *bias, void *y, int64_t at,
                              int bf, int wt, int y_f32) {
    if (wt == WT_INT8) v = rnd(v * from_bf16(scale[r]), 1);
    v += bias ? load(bias, r, bf) : 0.0f;
    if (y_f32)
        ((float *)y)[at] = rnd(v, bf);
    else
        store(y, at, v, bf);
}

/* y[i, r] = x[i] . w[r] for m <= LINEAR_GROUP rows of xf (float32, ld16w's order for wt) and every
 * weight row r: each weight element is read once per pass. Inlined per (m, wt) constant pair. y is
 * of the model dtype bf, or float32 holding the values rounded to it (y_f32). int8: the sum times
 * the row's scale rounded to bfloat16 (what torch's int8 weight-only kernel returns), then the bias. */
static inline __attribute__((always_inline)) void linear_group(const float *xf, const void *w,
                                                                const bf16 *scale, const void *bias, void *y,
                                                                int64_t ys, int64_t m, int64_t n, int64_t k,
                                                                int bf, int wt, int y_f32) {
    int64_t size = wt == WT_F32 ? 4 : (wt == WT_BF16 ? 2 : 1);
    for (int64_t r = 0; r < n; r++) {
        const char *wr = (const char *)w + r * k * size;
        v8 acc[LINEAR_GROUP] = {0}, w0, w1;
        for (int64_t e = 0; e < k; e += 16) {
            if (wt == WT_BF16 && e % 32 == 0) __builtin_prefetch(wr + e * size + LINEAR_PREFETCH);
            ld16w(wr, e, wt, &w0, &w1);
            for (int64_t i = 0; i < m; i++) acc[i] += ld8(xf + i * k + e) * w0 + ld8(xf + i * k + e + 8) * w1;
        }
        for (int64_t i = 0; i < m; i++) linear_out(hsum8(acc[i]), r, scale, bias, y, i * ys + r, bf, wt, y_f32);
    }
}

/* 4-bit weights (WT_Q4): a row of k weights is k / Q4_GROUP groups of Q4_GROUP; a group is 16 bytes,
 * byte b holding element b in its low nibble and element b + 16 in its high one (q in 0..15, the
 * layout of GGUF's Q4_0 and Q4_1 blocks), and a float32 scale and offset, interleaved per row as
 * [k / Q4_GROUP, 2]. Weight j of group g is q_j * scale_g + offset_g in float32, two roundings
 * (the torch reference's `q * scale + offset`; ct_q4_dequant writes exactly these). */
#define Q4_GROUP 32

/* The 32 codes of one group as four float32 vectors of elements 0-7, 8-15, 16-23, 24-31 (exact). */
static inline void ld_q4(const uint8_t *p, v8 *q) {
#if defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m256 f[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
    memcpy(q, f, sizeof f);
#else
    float f[Q4_GROUP];
    for (int b = 0; b < 16; b++) {
        f[b] = (float)(p[b] & 0x0f);
        f[b + 16] = (float)(p[b] >> 4);
    }
    memcpy(q, f, sizeof f);
#endif
}

/* y[i, r] = x[i] . w[r] for m <= LINEAR_GROUP rows of xf (float32, natural order) and every 4-bit
 * weight row r, as sum over groups g of (scale_g * (x_g . q_g) + offset_g * sum(x_g)) with xsum
 * [m, k / Q4_GROUP] the rows' group sums: the dequantized product regrouped, equal to it within
 * float32 rounding (not to the bit; models/quant4.py states the bound). One fixed order of sums per
 * output, so a row's result does not depend on the others nor on the thread count. */
static inline __attribute__((always_inline)) void linear_group_q4(const float *xf, const float *xsum,
                                                                   const uint8_t *w, const float *sm,
                                                                   const void *bias, void *y, int64_t ys,
                                                                   int64_t m, int64_t n, int64_t k, int bf,
                                                                   int y_f32) {
    int64_t groups = k / Q4_GROUP;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *wr = w + r * (k / 2);
        const float *smr = sm + r * groups * 2;
        v8 acc[LINEAR_GROUP] = {0}, q[4];
        float off[LINEAR_GROUP] = {0};
        for (int64_t g = 0; g < groups; g++) {
            ld_q4(wr + g * 16, q);
            float scale = smr[2 * g], offset = smr[2 * g + 1];
            for (int64_t i = 0; i < m; i++) {
                const float *xg = xf + i * k + g * Q4_GROUP;
                v8 d = ld8(xg) * q[0] + ld8(xg + 8) * q[1] + ld8(xg + 16) * q[2] + ld8(xg + 24) * q[3];
                acc[i] += d * scale;
                off[i] += offset * xsum[i * groups + g];
            }
        }
        for (int64_t i = 0; i < m; i++)
            linear_out(hsum8(acc[i]) + off[i], r, NULL, bias, y, i * ys + r, bf, WT_Q4, y_f32);
    }
}

/* AVX-512 (x86 CPUs that have it, where -march=native enables it): the same products over 16 float32
 * lanes with fused multiply-adds, x in natural order (no `deal`). Each output's sum has one fixed
 * order, whatever the row count or thread count: 16 lanes, two accumulators taking alternate blocks
 * along k, added, then folded (hsum16). bfloat16 weights, where the CPU has AVX512_BF16, take
 * VDPBF16PS (pairs of bfloat16 products, float32 sums; inputs below 2^-126 count as zero) on the
 * bfloat16 input itself; else they are widened. Sums differ from the portable kernel's by float32
 * rounding; COTHINK_NATIVE_CFLAGS=-mno-avx512f builds that one here (tested both ways). */
#if defined(__AVX512F__)
#define LINEAR_WIDE 1

static inline float hsum16(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    v8 a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, &hi, sizeof b);
    return hsum8(a + b);
}

/* Elements i .. i+15 of a float32, bfloat16 or int8 weight row as float32 (exact), natural order */
static inline __m512 ld16w_wide(const void *p, int64_t i, int wt) {
    if (wt == WT_F32) return _mm512_loadu_ps((const float *)p + i);
    if (wt == WT_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16 *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
}

/* linear_group with 16-lane fused multiply-adds; xf float32 in natural order */
static inline __attribute__((always_inline)) void linear_group_wide(const float *xf, const void *w,
                                                                     const bf16 *scale, const void *bias,
                                                                     void *y, int64_t ys, int64_t m, int64_t n,
                                                                     int64_t k, int bf, int wt, int y_f32) {
    int64_t size = wt == WT_F32 ? 4 : (wt == WT_BF16 ? 2 : 1);
    for (int64_t r = 0; r < n; r++) {
        const char *wr = (const char *)w + r * k * size;
        __m512 a0[LINEAR_GROUP], a1[LINEAR_GROUP];
        for (int64_t i = 0; i < m; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        int64_t e = 0;
        for (; e + 32 <= k; e += 32) {
            __builtin_prefetch(wr + e * size + LINEAR_PREFETCH);
            /* float32: a step reads two cache lines (one prefetch left every other one to the hardware:
               SmolLM2 float32 decode 39.6-41.8 -> 48.3-54.3 tokens/s, 2-core Zen 4) */
            if (wt == WT_F32) __builtin_prefetch(wr + e * size + LINEAR_PREFETCH + 64);
            __m512 w0 = ld16w_wide(wr, e, wt), w1 = ld16w_wide(wr, e + 16, wt);
            for (int64_t i = 0; i < m; i++) {
                a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + i * k + e), w0, a0[i]);
                a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + i * k + e + 16), w1, a1[i]);
            }
        }
        if (e < k) { /* k is a multiple of 16 */
            __m512 w0 = ld16w_wide(wr, e, wt);
            for (int64_t i = 0; i < m; i++) a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + i * k + e), w0, a0[i]);
        }
        for (int64_t i = 0; i < m; i++)
            linear_out(hsum16(_mm512_add_ps(a0[i], a1[i])), r, scale, bias, y, i * ys + r, bf, wt, y_f32);
    }
}

/* WT_F32T: float32 weights [n, k] in tiles of PAIR_TILE outputs, tile t = outputs PAIR_TILE t ..
 * PAIR_TILE (t + 1) - 1 as [k][PAIR_TILE] (native.py `pack_f32_tiles`). Per input e the tile's weights
 * are two vectors and x[i][e] a broadcast: two fused multiply-adds per row into 2 x TILE_ROWS
 * accumulators, a GEMM tile with no horizontal sums, where linear_group_wide loads an input vector for
 * every multiply-add and folds 16 lanes per output and row. Each output's sum runs over e = 0 .. k-1 in
 * order (one chain of multiply-adds): a row's result is the same whatever the other rows and threads,
 * within float32 rounding of linear_group_wide's (a different order). Measured on a 2-core Zen 4 over 30
 * SmolLM2 layers' products and the lm_head (bench/linears.py, ms per pass of m rows, tiles /
 * linear_group_wide): m = 1 19.7 / 20.1, 8 19.8 / 36.3, 32 51.3 / 96.8; m = 512 689 against MKL's sgemm
 * 773 (docs/benchmarks.md). Prefetching the next tile during the row groups after the first measured
 * within noise. */
static inline __attribute__((always_inline)) void f32_tile(const float *wt, const float *x, int64_t k,
                                                            const float *bias, float *y, int64_t ys,
                                                            const int nr, __mmask16 m0, __mmask16 m1) {
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    for (int i = 0; i < nr; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < k; e++) {
        const float *b = wt + e * PAIR_TILE;
        prefetch_weight(b);
        prefetch_weight((const char *)b + 64);
        __m512 w0 = _mm512_loadu_ps(b), w1 = _mm512_loadu_ps(b + 16);
        for (int i = 0; i < nr; i++) {
            __m512 xb = _mm512_set1_ps(x[i * k + e]);
            a0[i] = _mm512_fmadd_ps(w0, xb, a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, xb, a1[i]);
        }
    }
    /* the bias after the sum, as linear_out adds it; a last tile's outputs past n are neither read nor written */
    __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int i = 0; i < nr; i++) {
        _mm512_mask_storeu_ps(y + i * ys, m0, bias ? _mm512_add_ps(a0[i], b0) : a0[i]);
        _mm512_mask_storeu_ps(y + i * ys + 16, m1, bias ? _mm512_add_ps(a1[i], b1) : a1[i]);
    }
}

/* WT_F32T weight rows begin .. end-1 (begin at a tile's start; end at one's, or n inside the last, padded
 * tile) for every group of TILE_ROWS rows of float32 x: a tile is read from memory once, the groups
 * after the first find it in cache */
static void linear_rows_f32_tiles(const float *x, const float *w, const float *bias, float *y, int64_t ys,
                                  int64_t m, int64_t k, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r += PAIR_TILE) {
        const float *wt = w + r * k, *b = bias ? bias + r : NULL;
        int64_t width = end - r < PAIR_TILE ? end - r : PAIR_TILE;
        __mmask16 m0 = width >= 16 ? 0xffff : (__mmask16)((1u << width) - 1);
        __mmask16 m1 = width <= 16 ? 0 : width == PAIR_TILE ? 0xffff : (__mmask16)((1u << (width - 16)) - 1);
        for (int64_t i0 = 0; i0 < m; i0 += TILE_ROWS) {
            const float *xi = x + i0 * k;
            float *yi = y + i0 * ys + r;
            switch (m - i0 < TILE_ROWS ? m - i0 : TILE_ROWS) { /* nr a constant in each: registers */
#define F32_CASE(M) case M: f32_tile(wt, xi, k, b, yi, ys, M, m0, m1); break;
                F32_CASE(12) F32_CASE(11) F32_CASE(10) F32_CASE(9) F32_CASE(8) F32_CASE(7)
                F32_CASE(6) F32_CASE(5) F32_CASE(4) F32_CASE(3) F32_CASE(2) F32_CASE(1)
#undef F32_CASE
            }
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) /* (every CPU with the first has the second) */
#define LINEAR_BF16_PAIRS 1
/* 32 bfloat16 from p (n < 32: the first n, zeros after) */
static inline __m512bh ld32h(const bf16 *p, int64_t n) {
    __m512i v = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
    return (__m512bh)v;
}

/* linear_group for bfloat16 weights and inputs: xb [m, k] bfloat16, natural order */
static inline __attribute__((always_inline)) void linear_group_bf16(const bf16 *xb, const void *w,
                                                                     const void *bias, void *y, int64_t ys,
                                                                     int64_t m, int64_t n, int64_t k,
                                                                     int y_f32) {
    for (int64_t r = 0; r < n; r++) {
        const bf16 *wr = (const bf16 *)w + r * k;
        __m512 a0[LINEAR_GROUP], a1[LINEAR_GROUP];
        for (int64_t i = 0; i < m; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        int64_t e = 0;
        for (; e + 64 <= k; e += 64) {
            __builtin_prefetch((const char *)(wr + e) + LINEAR_PREFETCH);
            __m512bh w0 = ld32h(wr + e, 32), w1 = ld32h(wr + e + 32, 32);
            for (int64_t i = 0; i < m; i++) {
                a0[i] = _mm512_dpbf16_ps(a0[i], ld32h(xb + i * k + e, 32), w0);
                a1[i] = _mm512_dpbf16_ps(a1[i], ld32h(xb + i * k + e + 32, 32), w1);
            }
        }
        if (e < k) { /* 16, 32 or 48 left */
            int64_t left = k - e, first = left < 32 ? left : 32;
            __m512bh w0 = ld32h(wr + e, first);
            for (int64_t i = 0; i < m; i++) a0[i] = _mm512_dpbf16_ps(a0[i], ld32h(xb + i * k + e, first), w0);
            if (left > 32) {
                __m512bh w1 = ld32h(wr + e + 32, left - 32);
                for (int64_t i = 0; i < m; i++)
                    a1[i] = _mm512_dpbf16_ps(a1[i], ld32h(xb + i * k + e + 32, left - 32), w1);
            }
        }
        for (int64_t i = 0; i < m; i++)
            linear_out(hsum16(_mm512_add_ps(a0[i], a1[i])), r, NULL, bias, y, i * ys + r, 1, WT_BF16, y_f32);
    }
}

/* WT_BF16P: bfloat16 weights [n, k] stored in tiles of PAIR_TILE outputs, tile t = outputs
 * PAIR_TILE t .. PAIR_TILE (t + 1) - 1 as [k / 2][PAIR_TILE] 32-bit pairs, pair p of output o being
 * (w[o][2p], w[o][2p + 1]) (native.py `pack_pairs`). The outputs lie along the vector lanes: per pair,
 * two weight vectors and one broadcast pair of each of up to LINEAR_GROUP rows, VDPBF16PS into
 * 2 x LINEAR_GROUP accumulators, no horizontal sums. Where linear_group_bf16 reads one input vector
 * per multiply and sums 32 lanes per output and row, this is a GEMM tile: measured on a 2-core
 * Zen 4 over 30 SmolLM2 layers' products (ms per step of m rows; this / linear_group_bf16 / oneDNN):
 * m = 1 8.6 / 10.3 / 10.4, 8 7.5 / 18.0 / 10.6, 32 19.9 / 44.2 / 22.1. Each output's lane sums its
 * pairs p = 0 .. k/2 - 1 in order: a row's result is the same whatever the other rows. */
/* 16 float32 rounded to bfloat16 as to_bf16 rounds each (nearest even, NaN quiet), as the bit patterns of
 * the bfloat16 values widened back to float32 */
static inline __m512i round_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* 16 outputs of a tile's result row (pairs, AMX): the float32 sums (times the int8 scale, rounded to
   bfloat16), + the bias (x's dtype), stored in the model dtype bf (or float32 holding the rounded
   values, y_f32): linear_out's arithmetic, 16 outputs at a time (widen16: the attention's, above) */
static inline void tile_out(__m512 v, const bf16 *scale, const void *bias, void *y, int bf, int y_f32) {
    if (scale) v = _mm512_castsi512_ps(round_bf16x16(_mm512_mul_ps(v, widen16(scale))));
    if (bias) v = _mm512_add_ps(v, bf ? widen16(bias) : _mm512_loadu_ps(bias));
    if (!bf) {
        _mm512_storeu_ps(y, v);
        return;
    }
    __m512i r = round_bf16x16(v);
    if (y_f32)
        _mm512_storeu_si512(y, r);
    else
        _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* A WT_BF16P tile's products for NR rows (constant after inlining) of bfloat16 x; y and the bias bfloat16 */
static inline __attribute__((always_inline)) void pairs_tile(const void *wt, const bf16 *x, int64_t k,
                                                              const void *bias, void *y, int64_t ys, int y_f32,
                                                              const int nr) {
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    for (int i = 0; i < nr; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const uint32_t *xr = (const uint32_t *)x;
    int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *b = (const uint32_t *)wt + p * PAIR_TILE;
        prefetch_weight(b);
        prefetch_weight((const char *)b + 64);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(b), w1 = (__m512bh)_mm512_loadu_si512(b + 16);
        for (int i = 0; i < nr; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[i * pairs + p]);
            a0[i] = _mm512_dpbf16_ps(a0[i], w0, xb);
            a1[i] = _mm512_dpbf16_ps(a1[i], w1, xb);
        }
    }
    int64_t y_size = y_f32 ? 4 : 2;
    for (int i = 0; i < nr; i++) {
        char *yi = (char *)y + i * ys * y_size;
        tile_out(a0[i], NULL, bias, yi, 1, y_f32);
        tile_out(a1[i], NULL, bias ? (const bf16 *)bias + 16 : NULL, yi + 16 * y_size, 1, y_f32);
    }
}

/* WT_INT8P: int8 weights in tiles of PAIR_TILE outputs in the order VPDPBUSD multiplies them (native.py
 * `pack_pairs`: tile t, per four inputs 4v .. 4v + 3, two 64-byte vectors, outputs 0-15 then 16-31, each
 * output's four weights plus 128 as unsigned bytes in its lane), with a bfloat16 scale per output, for k
 * a multiple of Q4_GROUP. x is taken as 8-bit codes per group of Q4_GROUP inputs (`quantize_groups`, as
 * GGUF's Q8_0 x Q8 dot products take it): VPDPBUSD gives the int32 dot product of each output's
 * weights plus 128 with the codes, less 128 times the codes' sum; per output acc
 * += d xd_g, and the result acc times its scale rounded to bfloat16, then the bias, as WT_INT8 applies
 * them: the int8 product of the 8-bit x, one fixed order per output whatever the rows
 * (models/quantize.py states its distance from WT_INT8's). Measured on a 2-core Zen 4, 30 SmolLM2 layers'
 * products and the lm_head (ms per step of m rows, 8-bit x / bfloat16 x with the weights widened to
 * bfloat16 pairs): m = 1 5.4-6.7 / 5.8-6.0 (three alternations: level within the noise), 32 21.1 / 30.1. */
/* WT_Q4P: 4-bit weights (WT_Q4's codes, scales and offsets, below) in tiles of PAIR_TILE outputs, for
 * bfloat16 x (native.py `pack_q4_pairs`). Tile t holds per group g of Q4_GROUP inputs and four inputs
 * 4u .. 4u + 3 of it a 64-byte vector in the order VPDPBUSD multiplies: byte 4j + i holds in its low
 * nibble the code of output j at input Q4_GROUP g + 4u + i and in its high nibble that of output 16 + j;
 * a mask, and a shift and a mask, give each output's four codes in a lane (stored in pairs of inputs, a
 * VPERMW per vector put them there: bench/linears.py's 121 SmolLM2 4-bit linears, builds alternating
 * twice, 1 row 5.98 / 6.09 -> 5.93 / 5.74 ms, 32 rows 20.5 / 20.6 -> 19.6 / 19.5). The tile's scales are
 * [k / Q4_GROUP][2][PAIR_TILE]: per group the outputs' scales, then their offsets. x is taken as 8-bit
 * codes per group of Q4_GROUP inputs (`quantize_groups`, as GGUF's Q4 x Q8 dot products take it): per
 * group d = xq_g . q_g in exact int32 sums, then per output acc += d (scale_g xd_g) and, apart, off +=
 * offset_g sum(x_g) (the 8-bit x's sum, xd_g times its codes'); the result acc + off: the product with
 * the 8-bit x, one fixed order per output whatever the rows, within the bound models/quant4.py states
 * (the 8-bit x's rounding and float32 sums). VPDPBUSD multiplies 64 byte pairs an instruction where VDPBF16PS multiplies 32 bfloat16 pairs
 * (both one a cycle on Zen 4), and the codes need no widening to bfloat16. Measured on a 2-core Zen 4
 * over 30 SmolLM2 layers' products and an int8 lm_head (ms per step of m rows, 8-bit x / bfloat16 x by
 * VDPBF16PS, the codes widened by a table): m = 1 4.1-4.9 / 4.2-5.0, 8 7.0-7.5 / 7.9, 32 21.8-22.2 /
 * 30.3-30.6.
 * WT_Q4PH: the same tiles with the scales and offsets as IEEE half (where every one of them is a half
 * exactly: GGUF's Q4_0 and Q4_1 store them so, and so does models/quant4.py's quantizer), widened to
 * float32 as read (VCVTPH2PS, exact): the same values and sums, so the same results to the bit, from 5
 * bits a weight instead of 6. */

/* The codes 0..15 as bfloat16 (exact), a table for VPERMW (entries 16..31 unused) */
static const uint16_t Q4_BF16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* 16 of a WT_Q4P tile's scales or offsets from element i of sm, as float32: float32, or half (WT_Q4PH) */
static inline __attribute__((always_inline)) __m512 q4_scales(const void *sm, int64_t i, const int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)sm + i)));
    return _mm512_loadu_ps((const float *)sm + i);
}

/* One group's 32 codes (x times inv, rounded to nearest even) stored at q; their 16 lanes' pairwise sums */
static inline __m512i quantize_group(const bf16 *x, float inv, int8_t *q) {
    __m512 iv = _mm512_set1_ps(inv);
    __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(widen16(x), iv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(widen16(x + 16), iv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(c1));
    return _mm512_add_epi32(c0, c1);
}

/* A bfloat16 row x [k] (k a multiple of Q4_GROUP) as 8-bit codes per group of Q4_GROUP inputs, as the
   4-bit products in pairs read it: the group's scale d = max |x| / 127, its codes x (1 / d) rounded to
   nearest (even), all 0 where d is 0, and (s) the sum of the values they stand for, d (sum of codes): the
   offsets' term takes that sum, so that the product is the one with the 8-bit x in both terms (with x's
   exact sum there, the codes' rounding times the group's all-positive 4-bit codes goes uncancelled:
   SmolLM2 perplexity +2.8% over bfloat16 rather than +0.8%), or (c) 128 (sum of codes), what int8
   weights stored plus 128 add to the group's dot product (models/quant4.py `quantize_activations`, to
   the bit) */
static void quantize_groups(const bf16 *x, int64_t k, int8_t *q, float *d, float *s, int32_t *c) {
    int64_t groups = k / Q4_GROUP;
    /* 16 groups at a time: their maxima and code sums each folded into a lane of one vector (fold16x16:
       two transposes where 16 groups took 32 horizontal reductions, each a chain of shuffles), the scales'
       divisions in one vector (the same IEEE divisions); then the groups left one by one. The same codes,
       scales and sums to the bit (the maxima and int32 sums do not depend on the order). */
    for (int64_t g = 0; g + 16 <= groups; g += 16) {
        v16 top[16], sums[16];
        for (int j = 0; j < 16; j++) {
            const bf16 *p = x + (g + j) * Q4_GROUP;
            top[j] = (v16)_mm512_max_ps(_mm512_abs_ps(widen16(p)), _mm512_abs_ps(widen16(p + 16)));
        }
        __m512 dg = _mm512_div_ps((__m512)fold16x16(top, FOLD_MAX), _mm512_set1_ps(127.0f));
        float inv[16];
        _mm512_storeu_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dg, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                                  _mm512_set1_ps(1.0f), dg));
        for (int j = 0; j < 16; j++) {
            const bf16 *p = x + (g + j) * Q4_GROUP;
            sums[j] = (v16)quantize_group(p, inv[j], q + (g + j) * Q4_GROUP);
        }
        __m512i codes = (__m512i)fold16x16(sums, FOLD_ADD_I32);
        _mm512_storeu_ps(d + g, dg);
        if (s) _mm512_storeu_ps(s + g, _mm512_mul_ps(dg, _mm512_cvtepi32_ps(codes)));
        if (c) _mm512_storeu_si512(c + g, _mm512_mullo_epi32(codes, _mm512_set1_epi32(128)));
    }
    for (int64_t g = groups / 16 * 16; g < groups; g++) {
        __m512 lo = widen16(x + g * Q4_GROUP), hi = widen16(x + g * Q4_GROUP + 16);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float dg = top / 127.0f;
        int32_t codes = _mm512_reduce_add_epi32(quantize_group(x + g * Q4_GROUP, dg != 0.0f ? 1.0f / dg : 0.0f,
                                                               q + g * Q4_GROUP));
        d[g] = dg;
        if (s) s[g] = dg * (float)codes;
        if (c) c[g] = 128 * codes;
    }
}

/* A WT_Q4P or WT_INT8P tile's products for NR rows (constant after inlining) of 8-bit x
   (`quantize_groups`: per group of Q4_GROUP inputs the codes xq and their scale xd): per group d = xq_g
   . w_g by VPDPBUSD (exact int32 sums; the weights the unsigned side: 4-bit codes as they are, int8 ones
   plus 128, whose 128 sum(xq_g) xc the sums start from, negated), then per output acc += d xd_g (4-bit:
   times scale_g, and apart off += offset_g xsum_g, xsum the 8-bit x's group sums). KIND (a constant):
   WT_Q4P (sm the tile's float32 scales and offsets), WT_Q4PH (halves) or WT_INT8P (sm the outputs'
   bfloat16 scales, applied as WT_INT8 applies them) */
static inline __attribute__((always_inline)) void quads_rows(const void *wt, const void *sm,
                                                               const int8_t *xq, const float *xd, const float *xsum,
                                                               const int32_t *xc, int64_t k, const void *bias,
                                                               void *y, int64_t ys, int bf, int y_f32,
                                                               const int nr, const int kind) {
    const int i8 = kind == WT_INT8P, half = kind == WT_Q4PH;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 a0[LINEAR_GROUP], a1[LINEAR_GROUP];
    __m512i d0[LINEAR_GROUP], d1[LINEAR_GROUP];
    for (int i = 0; i < nr; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    int64_t groups = k / Q4_GROUP;
    for (int64_t g = 0; g < groups; g++) {
        for (int i = 0; i < nr; i++) /* int8: the sums less 128 sum(xq_g) from the start (exact in int32) */
            d0[i] = d1[i] = i8 ? _mm512_set1_epi32(-xc[i * groups + g]) : _mm512_setzero_si512();
        for (int64_t u = 0; u < Q4_GROUP / 4; u++) { /* inputs 4u .. 4u + 3 of the group */
            __m512i w0, w1;
            if (i8) { /* two vectors of 64 bytes as they are */
                const uint8_t *b = (const uint8_t *)wt + (g * (Q4_GROUP / 4) + u) * 4 * PAIR_TILE;
                prefetch_weight(b);
                prefetch_weight(b + 64);
                w0 = _mm512_loadu_si512(b);
                w1 = _mm512_loadu_si512(b + 64);
            } else {
                const uint8_t *b = (const uint8_t *)wt + (g * (Q4_GROUP / 2) + 2 * u) * PAIR_TILE;
                prefetch_weight(b);
                __m512i c = _mm512_loadu_si512(b);
                w0 = _mm512_and_si512(c, low);
                w1 = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
            }
            for (int i = 0; i < nr; i++) {
                int32_t four;
                memcpy(&four, xq + i * k + g * Q4_GROUP + 4 * u, sizeof four);
                __m512i xb = _mm512_set1_epi32(four);
                d0[i] = _mm512_dpbusd_epi32(d0[i], w0, xb);
                d1[i] = _mm512_dpbusd_epi32(d1[i], w1, xb);
            }
        }
        if (i8) {
            for (int i = 0; i < nr; i++) {
                __m512 dx = _mm512_set1_ps(xd[i * groups + g]);
                a0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0[i]), dx, a0[i]);
                a1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1[i]), dx, a1[i]);
            }
            continue;
        }
        int64_t s = g * 2 * PAIR_TILE, bytes = half ? 2 : 4; /* the group's scales: `bytes` cache lines */
        for (int c = 0; c < bytes; c++)
            __builtin_prefetch((const char *)sm + s * bytes + LINEAR_PREFETCH / 2 * bytes + 64 * c);
        __m512 s0 = q4_scales(sm, s, half), s1 = q4_scales(sm, s + 16, half);
        for (int i = 0; i < nr; i++) {
            __m512 dx = _mm512_set1_ps(xd[i * groups + g]);
            a0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0[i]), _mm512_mul_ps(s0, dx), a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1[i]), _mm512_mul_ps(s1, dx), a1[i]);
        }
    }
    int64_t size = bf ? 2 : 4, y_size = bf && !y_f32 ? 2 : 4;
    if (i8) {
        for (int i = 0; i < nr; i++) {
            char *yi = (char *)y + i * ys * y_size;
            tile_out(a0[i], sm, bias, yi, bf, y_f32);
            tile_out(a1[i], (const bf16 *)sm + 16, bias ? (const char *)bias + 16 * size : NULL, yi + 16 * y_size,
                     bf, y_f32);
        }
        return;
    }
    /* the offsets' sums, after (the tile's scales in cache): fewer registers live in the loop above */
    __m512 f[2][LINEAR_GROUP];
    for (int i = 0; i < nr; i++) f[0][i] = f[1][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 f0 = q4_scales(sm, g * 2 * PAIR_TILE + 32, half), f1 = q4_scales(sm, g * 2 * PAIR_TILE + 48, half);
        for (int i = 0; i < nr; i++) {
            __m512 xs = _mm512_set1_ps(xsum[i * groups + g]);
            f[0][i] = _mm512_fmadd_ps(f0, xs, f[0][i]);
            f[1][i] = _mm512_fmadd_ps(f1, xs, f[1][i]);
        }
    }
    for (int i = 0; i < nr; i++) {
        char *yi = (char *)y + i * ys * y_size;
        tile_out(_mm512_add_ps(a0[i], f[0][i]), NULL, bias, yi, 1, y_f32);
        tile_out(_mm512_add_ps(a1[i], f[1][i]), NULL, bias ? (const bf16 *)bias + 16 : NULL, yi + 16 * y_size, 1,
                 y_f32);
    }
}

/* Rows a pass of quads_rows takes: four rows' 16 accumulators stay in registers (eight spilled: 30
 * SmolLM2 4-bit layers at 32 rows 24.6-28.6 -> 21.8-22.2 ms). Each pass unmasks its tile's 4-bit codes
 * again: unpacking a tile once per product for all passes into a buffer read as int8 pairs was slower
 * (bench/linears.py int4, alternating builds twice, ms: 8 rows 8.49 / 8.49 -> 10.62 / 10.90, 32 rows
 * 19.29 / 21.87 -> 22.08 / 23.32) */
#define QUAD_ROWS 4
static inline __attribute__((always_inline)) void quads_tile(const void *wt, const void *sm,
                                                               const int8_t *xq, const float *xd, const float *xsum,
                                                               const int32_t *xc, int64_t k, const void *bias,
                                                               void *y, int64_t ys, int bf, int y_f32,
                                                               const int nr, const int kind) {
    int64_t groups = k / Q4_GROUP, y_size = bf && !y_f32 ? 2 : 4;
    if (nr > QUAD_ROWS) {
        quads_rows(wt, sm, xq, xd, xsum, xc, k, bias, y, ys, bf, y_f32, QUAD_ROWS, kind);
        quads_rows(wt, sm, xq + QUAD_ROWS * k, xd + QUAD_ROWS * groups, xsum ? xsum + QUAD_ROWS * groups : NULL,
                   xc ? xc + QUAD_ROWS * groups : NULL, k, bias, (char *)y + QUAD_ROWS * ys * y_size, ys, bf, y_f32,
                   nr - QUAD_ROWS, kind);
    } else {
        quads_rows(wt, sm, xq, xd, xsum, xc, k, bias, y, ys, bf, y_f32, nr, kind);
    }
}

/* tiles of outputs begin .. end-1 (multiples of PAIR_TILE) of a WT_BF16P, WT_INT8P or WT_Q4P weight (with
   its scale) for every group of rows of xb [m, k] bfloat16 (TILE_ROWS of them for bfloat16 pairs,
   LINEAR_GROUP for int8 and 4-bit); y and the bias of the model dtype bf (y_f32:
   y float32 holding the rounded values); int8 and 4-bit: xq, xd, the rows' 8-bit codes and scales, and
   4-bit xsum, int8 xc, what `quads_rows` takes of their group sums. */
static void linear_rows_pairs(const bf16 *xb, const float *xsum, const int8_t *xq, const float *xd,
                              const int32_t *xc, const void *w, int wt_kind, const void *scale, const void *bias,
                              void *y, int64_t ys, int64_t m, int64_t k, int64_t begin, int64_t end, int bf,
                              int y_f32) {
    int q4 = WT_Q4_PAIRS(wt_kind), quads = q4 || wt_kind == WT_INT8P;
    int64_t size = bf ? 2 : 4, y_size = bf && !y_f32 ? 2 : 4, groups = k / Q4_GROUP;
    for (int64_t r = begin; r < end; r += PAIR_TILE) {
        const void *wt = (const char *)w + r * weight_row_bytes(wt_kind, k);
        const void *sc = !scale ? NULL : q4 ? (const char *)scale + r * groups * 2 * (wt_kind == WT_Q4PH ? 2 : 4)
                                            : (const void *)((const bf16 *)scale + r);
        const void *b = bias ? (const char *)bias + r * size : NULL;
        for (int64_t i0 = 0; i0 < m; i0 += quads ? LINEAR_GROUP : TILE_ROWS) {
            const bf16 *x = xb + i0 * k;
            const float *xs = q4 ? xsum + i0 * groups : NULL, *xdi = quads ? xd + i0 * groups : NULL;
            const int8_t *xqi = quads ? xq + i0 * k : NULL;
            const int32_t *xci = q4 || !quads ? NULL : xc + i0 * groups;
            void *yi = (char *)y + (i0 * ys + r) * y_size;
#define PAIRS_CASE(M)                                                                   \
    case M:                                                                             \
        if (!quads)                                                                     \
            pairs_tile(wt, x, k, b, yi, ys, y_f32, M);                                  \
        else if (wt_kind == WT_Q4PH)                                                    \
            quads_tile(wt, sc, xqi, xdi, xs, xci, k, b, yi, ys, 1, y_f32, M, WT_Q4PH);  \
        else if (wt_kind == WT_Q4P)                                                     \
            quads_tile(wt, sc, xqi, xdi, xs, xci, k, b, yi, ys, 1, y_f32, M, WT_Q4P);   \
        else                                                                            \
            quads_tile(wt, sc, xqi, xdi, xs, xci, k, b, yi, ys, bf, y_f32, M, WT_INT8P); \
        break;
            if (!quads && m - i0 > LINEAR_GROUP) {
                switch (m - i0 < TILE_ROWS ? m - i0 : TILE_ROWS) {
#define WIDE_CASE(M) case M: pairs_tile(wt, x, k, b, yi, ys, y_f32, M); break;
                    WIDE_CASE(12) WIDE_CASE(11) WIDE_CASE(10) WIDE_CASE(9)
#undef WIDE_CASE
                }
                continue;
            }
            switch (m - i0 < LINEAR_GROUP ? m - i0 : LINEAR_GROUP) {
                PAIRS_CASE(8) PAIRS_CASE(7) PAIRS_CASE(6) PAIRS_CASE(5)
                PAIRS_CASE(4) PAIRS_CASE(3) PAIRS_CASE(2) PAIRS_CASE(1)
            }
#undef PAIRS_CASE
        }
    }
}

/* Wider products of a WT_BF16P weight (PAIRS_WIDE_MIN_ROWS rows or more: prefill chunks, steps of many
 * coroutines) as a GEMM: tasks of up to PAIRS_WIDE_BLOCK rows of x against a panel of two tiles (64
 * outputs; one where a weight ends in an odd tile), six rows at a time: per pair four weight vectors, a
 * broadcast pair per row and 24 VDPBF16PS into 24 accumulators, where pairs_tile takes two vectors
 * and twelve broadcasts. A task's first six rows prefetch the panel's two streams as pairs_tile does.
 * Each output's lane sums its pairs in order from zero, as in pairs_tile: a row's result is the same to
 * the bit as alone (a decode step's). Measured on a 2-core Zen 4, SmolLM2's linears (bench/linears.py;
 * ad hoc, alternating in one process, per-round medians): against pairs_tile 1.06x at 24 and 32 rows,
 * 0.95x at 16 (hence PAIRS_WIDE_MIN_ROWS); against oneDNN's packed bfloat16 GEMM, which took these
 * products before, 1.2x at 48 rows, 1.04x at 128, 1.02-1.04x at 512 (in cache 1.1x).
 * Up to PAIRS_WIDE_BLOCK rows (a decode step of many coroutines) a panel is one task: pairs_wide_panels. */
#define PAIRS_WIDE_ROWS 6
#define PAIRS_WIDE_BLOCK 48
#define PAIRS_WIDE_MIN_ROWS 24

typedef struct {
    const bf16 *x; /* [m, k], row stride xs */
    const void *w, *bias;
    void *y;
    int64_t xs, ys, m, n, k;
    int y_f32;
    int64_t doubles, singles; /* panels: `doubles` of two tiles, then `singles` of one */
    int64_t stride;           /* pairs_wide_panels: its tasks */
    atomic_uchar *claimed;    /* pairs_wide_panels: per panel, taken */
} PairsWideJob;

/* the first output of a PairsWideJob's panel, and its tiles */
static inline int64_t wide_panel_at(const PairsWideJob *j, int64_t panel, int *tiles) {
    *tiles = panel < j->doubles ? 2 : 1;
    return (panel < j->doubles ? 2 * panel : j->doubles + panel) * PAIR_TILE;
}

/* NR rows (xr, row stride xs in pairs) x TILES tiles (wt: the first, the next pairs * PAIR_TILE after
   it) of a WT_BF16P weight, NR and TILES constant after inlining; y and the bias bfloat16; `lead`: prefetch
   the tiles' streams ahead; `pre` (or NULL): per pair, prefetch its next pre_step bytes */
static inline __attribute__((always_inline)) void pairs_wide(const uint32_t *xr, int64_t xs, const uint32_t *wt,
                                                              int64_t pairs, const void *bias, void *y, int64_t ys,
                                                              int y_f32, int lead, const char *pre, int64_t pre_step,
                                                              const int nr, const int tiles) {
    __m512 acc[PAIRS_WIDE_ROWS][4];
    const uint32_t *w1 = wt + pairs * PAIR_TILE;
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < 2 * tiles; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[4];
        if (pre)
            for (int64_t o = 0; o < pre_step; o += 64) __builtin_prefetch(pre + p * pre_step + o, 0, 2);
        for (int u = 0; u < 2 * tiles; u++) {
            const uint32_t *b = (u < 2 ? wt : w1) + p * PAIR_TILE + 16 * (u % 2);
            if (lead) prefetch_weight(b);
            w[u] = (__m512bh)_mm512_loadu_si512(b);
        }
        for (int i = 0; i < nr; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[i * xs + p]);
            for (int u = 0; u < 2 * tiles; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], w[u], xb);
        }
    }
    int64_t y_size = y_f32 ? 4 : 2;
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < 2 * tiles; u++)
            tile_out(acc[i][u], NULL, bias ? (const bf16 *)bias + 16 * u : NULL,
                     (char *)y + (i * ys + 16 * u) * y_size, 1, y_f32);
}

/* Rows' passes of a PairsWideJob's panel that prefetch the next one's weight, a share each */
#define PAIRS_WIDE_PREFETCH_PASSES 4

/* Rows r0 .. r1-1 of panel `panel` of a PairsWideJob, six at a time; passes 1 .. PAIRS_WIDE_PREFETCH_PASSES
   prefetch panel `next`'s weight (-1: none); `lead`: the first pass prefetches this panel's streams ahead.
   Inlined: where `next` is -1 (a prefill chunk's tasks) the passes keep no prefetch branch */
static inline __attribute__((always_inline)) void wide_panel(const PairsWideJob *j, int64_t panel, int64_t r0,
                                                              int64_t r1, int64_t next, int lead) {
    int64_t pairs = j->k / 2, y_size = j->y_f32 ? 4 : 2, passes = (r1 - r0 + PAIRS_WIDE_ROWS - 1) / PAIRS_WIDE_ROWS;
    int tiles, next_tiles = 0;
    int64_t o = wide_panel_at(j, panel, &tiles), step = 0;
    const uint32_t *wt = (const uint32_t *)j->w + o * pairs;
    const void *bias = j->bias ? (const bf16 *)j->bias + o : NULL;
    const char *nw = NULL;
    int64_t shares = passes - 1 < PAIRS_WIDE_PREFETCH_PASSES ? passes - 1 : PAIRS_WIDE_PREFETCH_PASSES;
    if (next >= 0 && shares > 0) { /* a pass's share of each pair's weight lines, whole lines */
        nw = (const char *)((const uint32_t *)j->w + wide_panel_at(j, next, &next_tiles) * pairs);
        step = (next_tiles * PAIR_TILE * 4 / 64 + shares - 1) / shares * 64;
    }
    for (int64_t i = r0, pass = 0; i < r1; i += PAIRS_WIDE_ROWS, pass++) {
        const uint32_t *xr = (const uint32_t *)(j->x + i * j->xs);
        void *y = (char *)j->y + (i * j->ys + o) * y_size;
        int64_t from = (pass - 1) * step * pairs; /* the share's first byte */
        const char *pre = nw && pass >= 1 && from < next_tiles * PAIR_TILE * 4 * pairs ? nw + from : NULL;
        int first = lead && !pass;
#define WIDE(NR)                                                                                    \
    (tiles == 2 ? pairs_wide(xr, j->xs / 2, wt, pairs, bias, y, j->ys, j->y_f32, first, pre, step, NR, 2) \
                : pairs_wide(xr, j->xs / 2, wt, pairs, bias, y, j->ys, j->y_f32, first, pre, step, NR, 1))
        UP_TO_SIX(r1 - i < PAIRS_WIDE_ROWS ? r1 - i : PAIRS_WIDE_ROWS, WIDE)
#undef WIDE
    }
}

/* tasks begin .. end-1 of a PairsWideJob: task t is row block t % blocks of panel t / blocks */
static void pairs_wide_tasks(void *ctx, int64_t begin, int64_t end) {
    const PairsWideJob *j = ctx;
    int64_t blocks = (j->m + PAIRS_WIDE_BLOCK - 1) / PAIRS_WIDE_BLOCK;
    for (int64_t t = begin; t < end; t++) {
        int64_t r0 = t % blocks * PAIRS_WIDE_BLOCK;
        wide_panel(j, t / blocks, r0, r0 + PAIRS_WIDE_BLOCK < j->m ? r0 + PAIRS_WIDE_BLOCK : j->m, -1, 1);
    }
}

/* the first panel from `panel` on in steps of `stride` that this call takes (j->claimed), or past the last */
static int64_t claim_panel(const PairsWideJob *j, int64_t panel, int64_t stride) {
    int64_t panels = j->doubles + j->singles;
    while (panel < panels && atomic_exchange(&j->claimed[panel], 1)) panel += stride;
    return panel;
}

/* A PairsWideJob of one row block (m <= PAIRS_WIDE_BLOCK: a decode step of many coroutines) by panels:
 * task k of `stride` takes panels k, k + stride, .., each panel's passes prefetching the next it takes, so
 * that panel's first pass finds its weight near rather than waiting on memory (with tasks of a panel
 * each, taken in turns, the next was unknown); then, from the last, any panel not yet taken (a thread
 * that joins late or runs slower). Measured on a 2-core Zen 4 (SmolLM2 bfloat16, ad hoc: the fused decode
 * layers of 24, 28 and 32 coroutines over a 256-token context, this and the tasks of a panel each
 * alternating step by step in one process, medians of 4-6 runs): 1.11x, 1.06x, 1.10x. Prefill chunks
 * (128 and 512 rows, whose panels have many passes) took 0.99x and 0.98x of their products' time this
 * way: their row blocks stay tasks of their own. */
static void pairs_wide_panels(void *ctx, int64_t begin, int64_t end) {
    const PairsWideJob *j = ctx;
    int64_t panels = j->doubles + j->singles;
    for (int64_t k = begin; k < end; k++) {
        for (int64_t panel = claim_panel(j, k, j->stride), lead = 1; panel < panels; lead = 0) {
            int64_t next = panel + j->stride;
            while (next < panels && atomic_load(&j->claimed[next])) next += j->stride;
            wide_panel(j, panel, 0, j->m, next < panels ? next : -1, (int)lead);
            panel = claim_panel(j, next, j->stride);
        }
    }
    for (int64_t panel = panels - 1; panel >= 0; panel--)
        if (!atomic_exchange(&j->claimed[panel], 1)) wide_panel(j, panel, 0, j->m, -1, 1);
}
#endif

/* linear_group_q4 with 16-lane fused multiply-adds: per group d = x . q over 16 lanes, then
 * acc += d * scale; x in natural order. Float32 inputs (bf 0) widen the codes to float32; bfloat16
 * inputs (bf 1: x [m, k] bfloat16) where the CPU has AVX-512 BF16 widen them to bfloat16 by a table
 * (exact) and take d in one VDPBF16PS over the group's 16 pairs (products exact, float32 sums): 4
 * vector instructions per group where float32 takes 6 (a one-row 3072 x 576 product in cache 92 -> 71
 * us on two Zen 4 cores; streamed from memory, as in decode, ~3%: reading bounds it there) */
static inline __attribute__((always_inline)) void linear_group_q4_wide(const void *x, const float *xsum,
                                                                        const uint8_t *w, const float *sm,
                                                                        const void *bias, void *y, int64_t ys,
                                                                        int64_t m, int64_t n, int64_t k, int bf,
                                                                        int y_f32) {
    int64_t groups = k / Q4_GROUP;
    const __m128i mask = _mm_set1_epi8(0x0f);
#if LINEAR_BF16_PAIRS
    const __m512i table = _mm512_loadu_si512(Q4_BF16);
#endif
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *wr = w + r * (k / 2);
        const float *smr = sm + r * groups * 2;
        __m512 acc[LINEAR_GROUP], d[LINEAR_GROUP];
        float off[LINEAR_GROUP] = {0};
        for (int64_t i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if (g % 4 == 0) { /* the codes and the scales ahead (int4 decode 61-65 -> 83-89 tokens/s here) */
                __builtin_prefetch(wr + g * 16 + LINEAR_PREFETCH);
                __builtin_prefetch(smr + 2 * g + LINEAR_PREFETCH / 4);
            }
            __m128i b = _mm_loadu_si128((const __m128i *)(wr + g * 16));
            /* elements 0-15 (the low nibbles), then 16-31 (the high ones) */
            __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
#if LINEAR_BF16_PAIRS
            if (bf) {
                __m512bh q = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo)), table);
                for (int64_t i = 0; i < m; i++)
                    d[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), ld32h((const bf16 *)x + i * k + g * Q4_GROUP, 32), q);
            } else
#endif
            {
                __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
                __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
                for (int64_t i = 0; i < m; i++) {
                    const float *xg = (const float *)x + i * k + g * Q4_GROUP;
                    d[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16), q1, _mm512_mul_ps(_mm512_loadu_ps(xg), q0));
                }
            }
            __m512 scale = _mm512_set1_ps(smr[2 * g]);
            float offset = smr[2 * g + 1];
            for (int64_t i = 0; i < m; i++) {
                acc[i] = _mm512_fmadd_ps(d[i], scale, acc[i]);
                off[i] += offset * xsum[i * groups + g];
            }
        }
        for (int64_t i = 0; i < m; i++)
            linear_out(hsum16(acc[i]) + off[i], r, NULL, bias, y, i * ys + r, bf, WT_Q4, y_f32);
    }
}
#define LINEAR_GROUP_Q4 linear_group_q4_wide
#define LINEAR_GROUP_W linear_group_wide
#else
#define LINEAR_WIDE 0
#define LINEAR_GROUP_Q4 linear_group_q4
#define LINEAR_GROUP_W linear_group
#endif
#ifndef LINEAR_BF16_PAIRS
#define LINEAR_BF16_PAIRS 0
#endif

/* AMX (x86 CPUs with tile registers, Linux): bfloat16 products on 16 x 16 tiles, for every row count,
 * so a row's result does not depend on the batch. The weight is the A operand as it is stored (16
 * output rows x 32 of k per tile, loaded with the row stride), x the B operand: its rows packed once
 * per call in the tiles' pair layout (`pack_pairs`, 16 rows a block, zero-padded). Four accumulator
 * tiles cover 64 outputs x 16 rows (`amx_tall`) or 32 x 32 (`amx_square`); each output's sum runs over
 * k in one fixed order. Output rows that do not fill a tile of 16 (the last of a layer with
 * n % 16 != 0) take the AVX-512 kernel. The
 * process asks the kernel for the tile state once (arch_prctl); refused, the AVX-512 kernel runs. */
#if LINEAR_BF16_PAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && \
    defined(SYS_arch_prctl)
#define LINEAR_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ready(void) {
    static atomic_int state = -1; /* -1: not asked yet */
    int s = atomic_load(&state);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        atomic_store(&state, s);
    }
    return s;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* every tile 16 rows of 64 bytes: 0-3 accumulators (16 x 16 float32), 4-5 weight, 6-7 x */
static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* x rows [m, k] (bfloat16, row stride k) into the B operand's layout: per block of 16 rows, per pair of
 * k, the 16 rows' two elements side by side (64 bytes); rows past m are zero. */
static void pack_pairs(const bf16 *x, int64_t m, int64_t k, bf16 *out) {
    int64_t blocks = (m + 15) / 16;
    memset(out, 0, (size_t)(blocks * k * 16) * sizeof(bf16));
    for (int64_t i = 0; i < m; i++) {
        bf16 *o = out + (i / 16) * k * 16 + (i % 16) * 2;
        for (int64_t p = 0; p < k / 2; p++) {
            o[p * 32] = x[i * k + 2 * p];
            o[p * 32 + 1] = x[i * k + 2 * p + 1];
        }
    }
}

/* One tile of results, 16 outputs (r0..) x 16 rows of x (i0..): bias, one rounding to bfloat16, into
 * y [m, n] (y_f32: float32 holding the rounded values), by tile_out. */
static void amx_out(const float *t, int64_t r0, int64_t i0, int64_t m, const void *bias, void *y, int64_t ys,
                    int y_f32) {
    float col[16];
    const bf16 *b = bias ? (const bf16 *)bias + r0 : NULL;
    for (int64_t c = 0; c < 16 && i0 + c < m; c++) {
        for (int a = 0; a < 16; a++) col[a] = t[a * 16 + c];
        void *yc = y_f32 ? (void *)((float *)y + (i0 + c) * ys + r0) : (void *)((bf16 *)y + (i0 + c) * ys + r0);
        tile_out(_mm512_loadu_ps(col), NULL, b, yc, 1, y_f32);
    }
}

/* Up to 64 outputs (r0.., `nr` blocks of 16) x 16 rows of x (xb: one packed block): four accumulators
 * over one x tile. What a step of up to 16 rows (a decode step) runs: four independent chains. */
static void amx_tall(const bf16 *xb, const bf16 *w, int64_t k, int64_t r0, int nr, float t[4][256]) {
    int64_t stride = k * (int64_t)sizeof(bf16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t e = 0; e < k; e += 32) {
        _tile_loadd(6, xb + e * 16, 64);
        _tile_loadd(4, w + r0 * k + e, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (nr > 1) {
            _tile_loadd(5, w + (r0 + 16) * k + e, stride);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (nr > 2) {
            _tile_loadd(7, w + (r0 + 32) * k + e, stride);
            _tile_dpbf16ps(2, 7, 6);
        }
        if (nr > 3) {
            _tile_loadd(4, w + (r0 + 48) * k + e, stride);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, t[0], 64);
    _tile_stored(1, t[1], 64);
    _tile_stored(2, t[2], 64);
    _tile_stored(3, t[3], 64);
}

/* 32 outputs (r0.., `nr` blocks of 16) x 32 rows of x (x0, x1: two packed blocks, x1 NULL: one) */
static void amx_square(const bf16 *x0, const bf16 *x1, const bf16 *w, int64_t k, int64_t r0, int nr,
                       float t[4][256]) {
    int64_t stride = k * (int64_t)sizeof(bf16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t e = 0; e < k; e += 32) {
        _tile_loadd(4, w + r0 * k + e, stride);
        _tile_loadd(6, x0 + e * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nr > 1) {
            _tile_loadd(5, w + (r0 + 16) * k + e, stride);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (x1) {
            _tile_loadd(7, x1 + e * 16, 64);
            _tile_dpbf16ps(2, 4, 7);
            if (nr > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, t[0], 64);
    _tile_stored(1, t[1], 64);
    _tile_stored(2, t[2], 64);
    _tile_stored(3, t[3], 64);
}

/* Weight rows 0 .. n-1 (a multiple of 16 of them) for every row of x: xp the packed rows. Each output's
 * sum is the same chain of tile products over k whichever routine computes it. */
static void linear_rows_amx(const bf16 *xp, const bf16 *w, const void *bias, void *y, int64_t ys, int64_t m,
                            int64_t k, int64_t n, int y_f32) {
    float t[4][256];
    int64_t blocks = (m + 15) / 16;
    amx_configure();
    if (blocks == 1) {
        for (int64_t r0 = 0; r0 < n; r0 += 64) {
            int nr = (int)((n - r0) / 16 < 4 ? (n - r0) / 16 : 4);
            amx_tall(xp, w, k, r0, nr, t);
            for (int a = 0; a < nr; a++) amx_out(t[a], r0 + 16 * a, 0, m, bias, y, ys, y_f32);
        }
    } else {
        for (int64_t r0 = 0; r0 < n; r0 += 32) {
            int nr = r0 + 32 <= n ? 2 : 1;
            for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
                const bf16 *x0 = xp + b0 * k * 16, *x1 = b0 + 1 < blocks ? x0 + k * 16 : NULL;
                amx_square(x0, x1, w, k, r0, nr, t);
                amx_out(t[0], r0, b0 * 16, m, bias, y, ys, y_f32);
                if (nr > 1) amx_out(t[1], r0 + 16, b0 * 16, m, bias, y, ys, y_f32);
                if (x1) amx_out(t[2], r0, b0 * 16 + 16, m, bias, y, ys, y_f32);
                if (x1 && nr > 1) amx_out(t[3], r0 + 16, b0 * 16 + 16, m, bias, y, ys, y_f32);
            }
        }
    }
    _tile_release();
}
#else
#define LINEAR_AMX 0
#endif

/* Whether ct_linear's bfloat16 products (k a multiple of 32, 16 or more outputs) run on AMX tiles */
int ct_linear_tiles(void) {
#if LINEAR_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* Whether ct_linear's bfloat16 products use the CPU's bfloat16 dot products: AVX-512 BF16 pairs, or
   AMX tiles (which need the pairs' build) */
int ct_linear_bf16_dot(void) { return LINEAR_BF16_PAIRS; }

/* Whether ct_linear takes float32 weights in tiles (WT_F32T): AVX-512 */
int ct_linear_f32_tiles(void) { return LINEAR_WIDE; }

#if LINEAR_BF16_PAIRS
#define LINEAR_CASE_BF16(M) linear_group_bf16((const bf16 *)xf, w, bias, y, j->ys, M, n, k, j->y_f32)
#else
#define LINEAR_CASE_BF16(M) LINEAR_GROUP_W(xf, w, scale, bias, y, j->ys, M, n, k, j->bf, WT_BF16, j->y_f32)
#endif
/* 4-bit and int8 pairs of bfloat16 rows: the products read the rows' 8-bit codes only */
#define LINEAR_CODES_ONLY(wt, bf) (LINEAR_BF16_PAIRS && (WT_Q4_PAIRS(wt) || (wt) == WT_INT8P) && (bf))
/* whether ct_linear hands its kernel the bfloat16 input rows themselves (else float32 ones) */
#define LINEAR_X_BF16(wt, bf)                                                                          \
    (LINEAR_BF16_PAIRS && ((wt) == WT_BF16 || (wt) == WT_BF16P || (wt) == WT_INT8P || WT_Q4_PAIRS(wt) || \
                           ((wt) == WT_Q4 && (bf))))
#define LINEAR_CASE(M)                                                                                   \
    case M:                                                                                              \
        if (j->wt == WT_Q4 && j->bf) /* bf a constant in each: the group loop holds no branch */          \
            LINEAR_GROUP_Q4(xf, xsum, w, (const float *)scale, bias, y, j->ys, M, n, k, 1, j->y_f32);    \
        else if (j->wt == WT_Q4)                                                                         \
            LINEAR_GROUP_Q4(xf, xsum, w, (const float *)scale, bias, y, j->ys, M, n, k, 0, j->y_f32);    \
        else if (j->wt == WT_BF16)                                                                       \
            LINEAR_CASE_BF16(M);                                                                         \
        else if (j->wt == WT_INT8)                                                                       \
            LINEAR_GROUP_W(xf, w, scale, bias, y, j->ys, M, n, k, j->bf, WT_INT8, j->y_f32);             \
        else                                                                                             \
            LINEAR_GROUP_W(xf, w, scale, bias, y, j->ys, M, n, k, j->bf, WT_F32, j->y_f32);              \
        break;

/* ct_linear's work, its weight rows split over threads: every row of x, prepared up front. */
typedef struct {
    const void *x;      /* [m, k] float32 in the kernel's order, or the bfloat16 rows (LINEAR_BF16_PAIRS) */
    const void *xp;     /* the bfloat16 rows packed for AMX (`pack_pairs`), or NULL */
    const float *xsum;  /* [m, k / Q4_GROUP]: the rows' group sums (WT_Q4, WT_Q4P(H) only) */
    const int8_t *xq;   /* [m, k]: the rows' 8-bit codes, and xd [m, k / Q4_GROUP] their scales (WT_Q4P(H), */
    const float *xd;    /* WT_INT8P), xc [m, k / Q4_GROUP] 128 times their group sums (WT_INT8P) */
    const int32_t *xc;
    const void *w, *bias, *scale;
    void *y;
    int64_t ys, m, k;
    int bf, wt, y_f32;
} LinearJob;

/* Weight rows begin .. end-1 of a LinearJob for every group of LINEAR_GROUP rows of x: a task's
 * weight rows are read from memory once, the groups after the first find them in cache. */
static void linear_rows(void *ctx, int64_t begin, int64_t end) {
    const LinearJob *j = ctx;
#if LINEAR_WIDE
    if (j->wt == WT_F32T) {
        linear_rows_f32_tiles(j->x, j->w, j->bias, j->y, j->ys, j->m, j->k, begin, end);
        return;
    }
#endif
#if LINEAR_BF16_PAIRS
    if (j->wt == WT_BF16P || j->wt == WT_INT8P || WT_Q4_PAIRS(j->wt)) { /* whole tiles of PAIR_TILE outputs */
        linear_rows_pairs(j->x, j->xsum, j->xq, j->xd, j->xc, j->w, j->wt, j->scale, j->bias, j->y, j->ys, j->m,
                          j->k, begin, end, j->bf, j->y_f32);
        return;
    }
#endif
    int64_t size = j->bf ? 2 : 4, n = end - begin, k = j->k, groups = k / Q4_GROUP;
    int64_t x_size = LINEAR_X_BF16(j->wt, j->bf) ? 2 : 4, y_size = j->y_f32 ? 4 : size;
    const void *w = (const char *)j->w + begin * weight_row_bytes(j->wt, k);
    /* int8: a bfloat16 per row; 4-bit: a float32 scale and offset per group */
    const void *scale = !j->scale ? NULL
                      : j->wt == WT_Q4 ? (const void *)((const float *)j->scale + begin * groups * 2)
                                       : (const void *)((const bf16 *)j->scale + begin);
    const void *bias = j->bias ? (const char *)j->bias + begin * size : NULL;
#if LINEAR_AMX
    if (j->xp) { /* whole tiles of 16 outputs on AMX, what is left below */
        int64_t tiled = (n / 16) * 16;
        linear_rows_amx(j->xp, w, bias, (char *)j->y + begin * y_size, j->ys, j->m, k, tiled, j->y_f32);
        if (tiled == n) return;
        w = (const bf16 *)w + tiled * k;
        bias = bias ? (const char *)bias + tiled * size : NULL;
        begin += tiled;
        n -= tiled;
    }
#endif
    for (int64_t i0 = 0; i0 < j->m; i0 += LINEAR_GROUP) {
        const float *xf = (const float *)((const char *)j->x + i0 * k * x_size);
        const float *xsum = j->xsum + i0 * groups;
        void *y = (char *)j->y + (i0 * j->ys + begin) * y_size;
        switch (j->m - i0 < LINEAR_GROUP ? j->m - i0 : LINEAR_GROUP) {
            LINEAR_CASE(1)
            LINEAR_CASE(2)
            LINEAR_CASE(3)
            LINEAR_CASE(4)
            LINEAR_CASE(5)
            LINEAR_CASE(6)
            LINEAR_CASE(7)
            LINEAR_CASE(8)
        }
    }
}

/* Weight rows a thread claims at a time: LINEAR_GRAIN (a tile of pairs, ~36-96 KiB of a SmolLM2-sized
 * layer), or up to LINEAR_GRAINS of them while every thread still gets about four claims (`linear_grain`) */
#define LINEAR_GRAIN 32
#define LINEAR_GRAINS 4

/* Longer runs of weight rows per claim: fewer restarts of the memory streams (and of the claims' shared
 * counter). Measured on two Zen 4 cores, 30 SmolLM2 layers and the lm_head at one row, 32 -> 128 rows a
 * claim: bfloat16 12.2-12.9 -> 9.4-10.7 ms, 4-bit 6.8-7.9 -> 4.5-5.3 ms. */
static int64_t linear_grain(int64_t n, int64_t threads) {
    int64_t per = n / (LINEAR_GRAIN * 4 * (threads > 1 ? threads : 1));
    return LINEAR_GRAIN * (per < 1 ? 1 : per > LINEAR_GRAINS ? LINEAR_GRAINS : per);
}

/* y = x w^T (+ bias) for x [m, k] (row stride xs), w [n, k] and y [m, n] (row stride ys); x, y and
 * the bias of the model dtype bf (or y float32 holding the rounded values, y_f32: the logits without
 * a widening pass), w of storage wt (int8: with `scale` [n], and x rounded to bfloat16 first, as
 * torch's int8 kernel takes it; 4-bit: `scale` the groups' [n, k / Q4_GROUP, 2] scales and offsets, x
 * as it is; 4-bit in pairs: [n / PAIR_TILE, k / Q4_GROUP, 2, PAIR_TILE], x bfloat16 taken as 8-bit codes,
 * `quantize_groups`); k a multiple of 16,
 * of Q4_GROUP for 4-bit (Python checks). Float32 sums in a fixed order per output, so a row's result
 * does not depend on the others nor on `threads`; bfloat16 results
 * rounded once, after the bias. A decode-sized product is bound by reading the weight: it is read
 * once, whatever m, its rows split over up to `threads` threads. A bfloat16 weight in pairs takes
 * PAIRS_WIDE_MIN_ROWS rows or more as a GEMM instead (pairs_wide_tasks: the same sums). */
/* ct_linear's inputs made ready: x's rows in the kernel's form (below), each row whole on one thread */
typedef struct {
    const void *x;
    int64_t xs, k;
    int bf, wt;
    float *xf, *xsum, *xd;
    int8_t *xq;
    int32_t *xc;
} LinearPrep;

static void prepare_rows(void *ctx, int64_t begin, int64_t end) {
    const LinearPrep *p = ctx;
    int64_t k = p->k, groups = k / Q4_GROUP, size = p->bf ? 2 : 4;
    int wt = p->wt;
    float *xf = p->xf, *xsum = p->xsum;
    for (int64_t i = begin; i < end; i++) {
        const char *xi = (const char *)p->x + i * p->xs * size;
        if (LINEAR_X_BF16(wt, p->bf)) { /* bfloat16 rows (4-bit: and their group sums; pairs: their 8-bit codes) */
            const bf16 *row = (const bf16 *)xi;
            if (!LINEAR_CODES_ONLY(wt, p->bf)) { /* the rows packed, as the products read them */
                row = (const bf16 *)xf + i * k;
                if (p->bf)
                    memcpy((bf16 *)xf + i * k, xi, (size_t)k * sizeof(bf16));
                else /* (WT_INT8P of float32 rows: x rounded to bfloat16, as WT_INT8 takes it) */
                    for (int64_t e = 0; e < k; e++) ((bf16 *)xf)[i * k + e] = to_bf16(((const float *)xi)[e]);
            }
            if (wt == WT_Q4)
                for (int64_t g = 0; g < groups; g++) {
                    float part[Q4_GROUP];
                    load_row(row + g * Q4_GROUP, Q4_GROUP, 1, part);
                    xsum[i * groups + g] = sum(part, Q4_GROUP);
                }
#if LINEAR_BF16_PAIRS
            if (WT_Q4_PAIRS(wt) || wt == WT_INT8P)
                quantize_groups(row, k, p->xq + i * k, p->xd + i * groups, wt == WT_INT8P ? NULL : xsum + i * groups,
                                wt == WT_INT8P ? p->xc + i * groups : NULL);
#endif
            continue;
        }
        load_row(xi, k, p->bf, xf + i * k);
        if (wt == WT_INT8) round_row(xf + i * k, k, 1);
        if (!LINEAR_WIDE) deal(xf + i * k, k, wt == WT_BF16, 0);
        if (wt == WT_Q4)
            for (int64_t g = 0; g < groups; g++) xsum[i * groups + g] = sum(xf + i * k + g * Q4_GROUP, Q4_GROUP);
    }
}

/* Rows of x a thread of ct_linear's preparation claims at a time (a decode step's few stay on one) */
#define PREP_GRAIN 16

void ct_linear(const void *x, int64_t xs, const void *w, const void *scale, const void *bias, void *y,
               int64_t ys, int64_t m, int64_t n, int64_t k, int bf, int wt, int y_f32, int64_t threads) {
    int64_t groups = k / Q4_GROUP;
    int own = m <= HELPER_TEAM_ROWS; /* a decode-sized product on the helpers, a prefill chunk's on OpenMP's */
#if LINEAR_BF16_PAIRS
    if (wt == WT_BF16P && bf && m >= PAIRS_WIDE_MIN_ROWS && xs % 2 == 0) { /* x read where it is */
        /* panels of two tiles, then single ones. Dealt (a decode step's rows), as many tiles per thread as
           can be: the panels of two a multiple of the threads (o_proj's 18 tiles on two threads: 9 and 9,
           where 9 panels took 5 and 4); a prefill chunk's tasks take one tile alone at most */
        int64_t tiles = (n + PAIR_TILE - 1) / PAIR_TILE, dealt = m <= PAIRS_WIDE_BLOCK ? threads : 1;
        int64_t doubles = tiles / (2 * dealt) * dealt, panels = tiles - doubles;
        PairsWideJob job = {x, w, bias, y, xs, ys, m, n, k, y_f32, doubles, panels - doubles, 0, NULL};
        if (m > PAIRS_WIDE_BLOCK) {
            int64_t blocks = (m + PAIRS_WIDE_BLOCK - 1) / PAIRS_WIDE_BLOCK;
            parallel_for(pairs_wide_tasks, &job, panels * blocks, 1, threads, own);
            return;
        }
        job.stride = panels < threads ? panels : threads;
        job.claimed = calloc((size_t)panels, sizeof *job.claimed);
        parallel_for(pairs_wide_panels, &job, job.stride, 1, threads, own);
        free(job.claimed);
        return;
    }
#endif
    LinearPrep prep = {x, xs, k, bf, wt, LINEAR_CODES_ONLY(wt, bf) ? NULL : malloc((size_t)(m * k) * sizeof(float)),
                       malloc((size_t)(m * groups + 1) * sizeof(float)), NULL, NULL, NULL};
    if (WT_Q4_PAIRS(wt) || wt == WT_INT8P) {
        prep.xq = malloc((size_t)(m * k));
        prep.xd = malloc((size_t)(m * groups) * sizeof(float));
        if (wt == WT_INT8P) prep.xc = malloc((size_t)(m * groups) * sizeof(int32_t));
    }
    parallel_for(prepare_rows, &prep, m, PREP_GRAIN, threads, own);
    void *xp = NULL;
#if LINEAR_AMX
    if (wt == WT_BF16 && k % 32 == 0 && n >= 16 && amx_ready()) {
        xp = malloc((size_t)(((m + 15) / 16) * k * 16) * sizeof(bf16));
        pack_pairs((const bf16 *)prep.xf, m, k, xp);
    }
#endif
    LinearJob job = {prep.xf, xp, prep.xsum, prep.xq, prep.xd, prep.xc, w, bias, scale, y, ys, m, k, bf, wt, y_f32};
    parallel_for(linear_rows, &job, n, linear_grain(n, threads), threads, own);
    free(prep.xf);
    free(xp);
    free(prep.xsum);
    free(prep.xq);
    free(prep.xd);
    free(prep.xc);
}

/* Eight float32 rounded to bfloat16 as to_bf16 rounds each (nearest even, NaN quiet) and stored. */
typedef uint16_t h8 __attribute__((vector_size(16)));
static inline void st8_bf16(bf16 *p, v8 x) {
    w8 u, nan;
    memcpy(&u, &x, sizeof u);
    nan = (w8)((u & 0x7fffffffu) > 0x7f800000u);
    w8 r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | (0x7fc0u & nan);
    h8 h = __builtin_convertvector(r, h8);
    memcpy(p, &h, sizeof h);
}

static inline void put8(void *row, int64_t e, v8 x, int bf) {
    if (bf)
        st8_bf16((bf16 *)row + e, x);
    else
        st8((float *)row + e, x);
}

typedef struct {
    const uint8_t *w;
    const float *sm;
    void *out;
    int64_t r0, k;
    int bf;
} DequantJob;

static void dequant_rows(void *ctx, int64_t begin, int64_t end) {
    const DequantJob *j = ctx;
    int64_t k = j->k, groups = k / Q4_GROUP;
    v8 q[4];
    for (int64_t r = j->r0 + begin; r < j->r0 + end; r++) {
        void *row = (char *)j->out + (r - j->r0) * k * (j->bf ? 2 : 4);
        for (int64_t g = 0; g < groups; g++) {
            const float *s = j->sm + (r * groups + g) * 2;
            ld_q4(j->w + r * (k / 2) + g * 16, q);
            for (int u = 0; u < 4; u++) put8(row, g * Q4_GROUP + 8 * u, q[u] * s[0] + s[1], j->bf);
        }
    }
}

/* The 4-bit weight rows r0 .. r1-1 (WT_Q4's layout) dequantized into out [r1 - r0, k], float32 (bf 0)
 * or bfloat16 (bf 1): q * scale + offset in float32, the two roundings of the torch reference
 * (models/quant4.py), to the bit; then rounded to bfloat16 where bf. Over up to `threads` threads of
 * OpenMP's team, the one the GEMM after it runs on (a 4-bit prefill dequantizes every weight per
 * chunk: on one thread ~15% of SmolLM2's). */
void ct_q4_dequant(const uint8_t *w, const float *sm, void *out, int bf, int64_t r0, int64_t r1, int64_t k,
                   int64_t threads) {
    DequantJob j = {w, sm, out, r0, k, bf};
    parallel_for(dequant_rows, &j, r1 - r0, 64, threads, 0);
}

/* RMSNorm of each head of x [T, heads, dim] (token stride ts, head stride hs; the q/k norms of
 * Qwen3 and Qwen3.5 on views of the q/k/v projection) into out [T, heads, dim], contiguous: per
 * token the rows of ct_rms_norm. */
void ct_head_rms_norm(const void *x, int64_t ts, int64_t hs, const void *w, void *out, int64_t tokens,
                      int64_t heads, int64_t dim, float eps, int zero_centred, int bf) {
    int64_t size = bf ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++) {
        NormJob j = {(const char *)x + t * ts * size, NULL, w, NULL, (char *)out + t * heads * dim * size, hs, 0, dim,
                     eps, zero_centred, bf};
        norm_rows(&j, 0, heads);
    }
}

/* Qwen3.5's attention output gate: out = x * sigmoid(gate) over x [T, heads * dim] (contiguous,
 * the attention output in the model dtype) and gate [T, heads, dim] (token stride gs, head stride
 * gh), sigmoid rounded to the dtype, then the product, as torch computes x * torch.sigmoid(gate).
 * out may be x. */
void ct_sigmoid_gate(const void *x, const void *gate, int64_t gs, int64_t gh, void *out, int64_t tokens,
                     int64_t heads, int64_t dim, int bf) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < dim; i++) {
                int64_t at = (t * heads + h) * dim + i;
                float s = rnd(sigmoid(load(gate, t * gs + h * gh + i, bf)), bf);
                store(out, at, load(x, at, bf) * s, bf);
            }
}

/* ct_decode_layers' inputs, as named structs. Each struct's fields are listed once, in an X-macro
 * that declares them and lists their offsets for ct_layout; cothink/ops/native.py mirrors them as
 * ctypes Structures and checks them against ct_layout when it loads the library. */
#define CT_DECLARE(type, name) type name;
#define CT_OFFSET(type, name) {CT_STRUCT_NAME "." #name, (int64_t)offsetof(CT_STRUCT, name)},

/* One linear of a layer, as ct_linear reads it: the weight (storage `wt`), its int8 row scales or
 * 4-bit group scales and offsets (NULL for a weight of the model dtype) and its bias (NULL: none). */
#define CT_LINEAR_FIELDS(X) X(const void *, weight) X(const void *, scale) X(const void *, bias)
typedef struct { CT_LINEAR_FIELDS(CT_DECLARE) } CtLinear;

/* One decoder layer. The mixer's projections are the attention's q/k/v and o, or Gated DeltaNet's
 * fused qkv/z/b/a input and its output projection. A missing norm is NULL. kv_slot: the layer's index
 * in the key pool, -1 for a Gated DeltaNet layer (whose conv .. gated_norm are then set). */
#define CT_LAYER_FIELDS(X)                                                                                     \
    X(const void *, in_norm) X(const void *, post_norm) X(CtLinear, mix_in) X(CtLinear, mix_out)            \
    X(CtLinear, gate_up) X(CtLinear, down) X(const void *, q_norm) X(const void *, k_norm) X(int64_t, kv_slot) \
    X(const void *, conv) X(const void *, a_log) X(const void *, dt_bias) X(const void *, gated_norm)
typedef struct { CT_LAYER_FIELDS(CT_DECLARE) } CtLayer;

/* The model's sizes; Gated DeltaNet's are 0 without such layers. eps: the RMSNorms'; l2_eps: the l2
 * norm's of Gated DeltaNet's q and k. */
#define CT_SHAPE_FIELDS(X)                                                                                  \
    X(int64_t, hidden) X(int64_t, heads) X(int64_t, kv_heads) X(int64_t, head_dim) X(int64_t, intermediate) \
    X(int64_t, gated) X(int64_t, zero_centred) X(int64_t, key_heads) X(int64_t, value_heads)                \
    X(int64_t, key_dim) X(int64_t, value_dim) X(int64_t, conv_kernel) X(float, eps) X(float, l2_eps)
typedef struct { CT_SHAPE_FIELDS(CT_DECLARE) } CtShape;

/* A step's keys: the pool (layer l of an attention layer's keys at pool_k + kv_slot * pool_layer
 * elements), where this step's T keys go (store_slots, rotated by key_cos/key_sin [T, rot]), and the
 * runs each item reads (ct_decode_attention's plan); `scale` the softmax's. */
#define CT_KEYS_FIELDS(X)                                                                                      \
    X(void *, pool_k) X(void *, pool_v) X(int64_t, pool_layer) X(const int64_t *, store_slots)                \
    X(const void *, key_cos) X(const void *, key_sin) X(int64_t, items) X(const int64_t *, rows)               \
    X(const int64_t *, run_start) X(const int64_t *, key_start) X(const int64_t *, slots) X(const void *, cos) \
    X(const void *, sin) X(int64_t, groups) X(const int64_t *, group_start) X(const int64_t *, group_runs)     \
    X(const int64_t *, shared_of) X(int64_t, rot) X(float, scale)
typedef struct { CT_KEYS_FIELDS(CT_DECLARE) } CtStepKeys;

/* One item of a Gated DeltaNet layer in a step: its conv tail [W-1, conv_dim] (row stride
 * tail_stride) and state [value_heads, key_dim, value_dim] before its token, and the buffers for
 * them after it. */
#define CT_LINEAR_ITEM_FIELDS(X)                                                                  \
    X(const void *, tail) X(int64_t, tail_stride) X(const float *, state) X(float *, state_out) \
    X(void *, tail_out)
typedef struct { CT_LINEAR_ITEM_FIELDS(CT_DECLARE) } CtLinearItem;

/* A Gated DeltaNet layer's inputs and outputs in a step: the step's pre-conv rows [T, conv_dim]
 * (model dtype), g and beta [T, value_heads] (float32), and one CtLinearItem per item (item i is
 * row i). Attention layers' entries are unused. */
#define CT_LINEAR_IO_FIELDS(X) X(void *, rows) X(float *, g) X(float *, beta) X(const CtLinearItem *, items)
typedef struct { CT_LINEAR_IO_FIELDS(CT_DECLARE) } CtLinearIO;

/* A step's logits after its last decoder layer: the final norm's weight, the lm_head (its storage wt,
 * `vocab` outputs) and the float32 rows [T, vocab] they go to. */
#define CT_HEAD_FIELDS(X) X(const void *, norm) X(CtLinear, linear) X(int64_t, wt) X(int64_t, vocab) X(float *, logits)
typedef struct { CT_HEAD_FIELDS(CT_DECLARE) } CtHead;

/* Every field of the structs above with its offset, then each struct's size (named by the struct):
 * what ct_layout returns, read by native.py to check its mirrors. */
typedef struct {
    const char *name;
    int64_t offset;
} CtField;

#define CT_SIZE(s) {#s, (int64_t)sizeof(s)},
static const CtField layout[] = {
#define CT_STRUCT CtLinear
#define CT_STRUCT_NAME "CtLinear"
    CT_LINEAR_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
#define CT_STRUCT CtLayer
#define CT_STRUCT_NAME "CtLayer"
    CT_LAYER_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
#define CT_STRUCT CtShape
#define CT_STRUCT_NAME "CtShape"
    CT_SHAPE_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
#define CT_STRUCT CtStepKeys
#define CT_STRUCT_NAME "CtStepKeys"
    CT_KEYS_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
#define CT_STRUCT CtLinearItem
#define CT_STRUCT_NAME "CtLinearItem"
    CT_LINEAR_ITEM_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
#define CT_STRUCT CtLinearIO
#define CT_STRUCT_NAME "CtLinearIO"
    CT_LINEAR_IO_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
#define CT_STRUCT CtHead
#define CT_STRUCT_NAME "CtHead"
    CT_HEAD_FIELDS(CT_OFFSET)
#undef CT_STRUCT
#undef CT_STRUCT_NAME
    CT_SIZE(CtLinear) CT_SIZE(CtLayer) CT_SIZE(CtShape) CT_SIZE(CtStepKeys) CT_SIZE(CtLinearItem) CT_SIZE(CtLinearIO)
    CT_SIZE(CtHead)
};

const CtField *ct_layout(int64_t *count) {
    *count = (int64_t)(sizeof layout / sizeof *layout);
    return layout;
}

typedef struct {
    int64_t hidden, hq, hkv, d, inter, gated, zero_centred, hk, hv, kd, vd, conv, rot, t, items, threads;
    float eps, l2_eps, scale;
    int bf, wt;
} Step;

/* One call's scratch rows (each [T, width] of the widest use) */
typedef struct {
    char *normed, *proj, *att, *gated, *mixed, *total, *gate_up, *act, *down, *qn, *kn;
    float *att_f;
} Scratch;

/* y = x W^T (+ b) with one of the layer's linears */
static void layer_linear(const Step *s, const CtLinear *lin, const void *x, int64_t k, void *y, int64_t n) {
    ct_linear(x, k, lin->weight, lin->scale, lin->bias, y, n, s->t, n, k, s->bf, s->wt, 0, s->threads);
}

/* Full attention from the normed rows into sc->mixed: q/k/v, the q/k norms (Qwen3, Qwen3.5), keys to
 * the pool, the decode attention, the output gate (Qwen3.5), o. */
static void attention_mixer(const Step *s, const CtLayer *w, const CtStepKeys *keys, Scratch *sc) {
    int64_t size = s->bf ? 2 : 4, t = s->t, att_n = s->hq * s->d, kv_n = s->hkv * s->d;
    int64_t q_out = att_n * (s->gated ? 2 : 1), qkv_n = q_out + 2 * kv_n;
    char *layer_k = (char *)keys->pool_k + w->kv_slot * keys->pool_layer * size;
    char *layer_v = (char *)keys->pool_v + w->kv_slot * keys->pool_layer * size;
    layer_linear(s, &w->mix_in, sc->normed, s->hidden, sc->proj, qkv_n);
    /* per head the query, then (gated) its gate: head stride 2d */
    const char *q = sc->proj, *k = sc->proj + q_out * size, *v = k + kv_n * size;
    int64_t qs = qkv_n, qh = s->gated ? 2 * s->d : s->d, ks = qkv_n;
    if (w->q_norm) {
        ct_head_rms_norm(q, qs, qh, w->q_norm, sc->qn, t, s->hq, s->d, s->eps, s->zero_centred, s->bf);
        ct_head_rms_norm(k, ks, s->d, w->k_norm, sc->kn, t, s->hkv, s->d, s->eps, s->zero_centred, s->bf);
        q = sc->qn, qs = att_n, qh = s->d, k = sc->kn, ks = kv_n;
    }
    ct_store_kv(k, ks, v, qkv_n, keys->store_slots, t, s->hkv, s->d, s->rot, keys->key_cos, keys->key_sin, layer_k,
                layer_v, s->bf, s->threads);
    decode_attention(q, qs, qh, s->hq, s->hkv, s->d, s->rot, s->items, keys->rows, keys->run_start,
                     keys->key_start, keys->slots, keys->cos, keys->sin, keys->groups, keys->group_start,
                     keys->group_runs, keys->shared_of, layer_k, layer_v, s->scale, sc->att_f,
                     s->bf, s->threads, 1);
    store_row(sc->att, sc->att_f, t * att_n, s->bf); /* the per-module path's .to(dtype) of the float32 output */
    if (s->gated) ct_sigmoid_gate(sc->att, sc->proj + s->d * size, qkv_n, 2 * s->d, sc->att, t, s->hq, s->d, s->bf);
    layer_linear(s, &w->mix_out, sc->att, att_n, sc->mixed, s->hidden);
}

/* Gated DeltaNet from the normed rows into sc->mixed: the fused input projection, its pre-conv rows
 * kept (the block's records), the gates, each item's token from its state (ct_gdn_token) and its new
 * conv tail, the gated output norm, the output projection. Item i is row i (one token each). */
static void gdn_mixer(const Step *s, const CtLayer *w, const CtLinearIO *io, Scratch *sc) {
    int64_t size = s->bf ? 2 : 4, t = s->t, value_n = s->hv * s->vd, conv_n = 2 * s->hk * s->kd + value_n;
    int64_t in_n = conv_n + value_n + 2 * s->hv, w1 = s->conv - 1;
    char *rows = io->rows;
    float *g = io->g, *beta = io->beta;
    layer_linear(s, &w->mix_in, sc->normed, s->hidden, sc->proj, in_n);
    for (int64_t r = 0; r < t; r++) memcpy(rows + r * conv_n * size, sc->proj + r * in_n * size, (size_t)(conv_n * size));
    const char *b = sc->proj + (conv_n + value_n) * size;
    ct_gdn_gates(b, b + s->hv * size, in_n, w->a_log, w->dt_bias, g, beta, t, s->hv, s->bf);
    for (int64_t i = 0; i < s->items; i++) {
        const CtLinearItem *item = &io->items[i];
        const char *tail = item->tail, *row = rows + i * conv_n * size;
        char *tail_out = item->tail_out;
        ct_gdn_token(tail, item->tail_stride, w1, row, w->conv, conv_n, s->hk, s->hv, s->kd, s->vd, g + i * s->hv,
                     beta + i * s->hv, item->state, item->state_out, sc->att_f + i * value_n, s->l2_eps, s->bf);
        /* the new tail: the old one's last W-2 rows, then this token's */
        for (int64_t j = 1; j < w1; j++)
            memcpy(tail_out + (j - 1) * conv_n * size, tail + j * item->tail_stride * size, (size_t)(conv_n * size));
        memcpy(tail_out + (w1 - 1) * conv_n * size, row, (size_t)(conv_n * size));
    }
    store_row(sc->att, sc->att_f, t * value_n, s->bf); /* core.to(dtype) */
    ct_gated_rms_norm(sc->att, sc->proj + conv_n * size, in_n, w->gated_norm, sc->gated, t, s->hv, s->vd, s->eps,
                      s->bf);
    layer_linear(s, &w->mix_out, sc->gated, value_n, sc->mixed, s->hidden);
}

/* The decoder layers of a decode step of t_rows single-token items, in one call: the calls the
 * per-module path makes for such a step, in its order, with its roundings, so the result is the same
 * to the bit (the Python loop around them costs about as much as the kernels' non-matmul work).
 * Llama, Qwen3 (q/k norms) and the Qwen3.5 hybrid (zero-centred norms, gated attention, Gated
 * DeltaNet layers).
 *
 * x [T, hidden] (contiguous) holds the embeddings and receives the last layer's output. Layer l is
 * layer[l] (linears of storage wt, as ct_linear); an attention layer reads and writes the keys of
 * `keys`, a Gated DeltaNet layer the buffers of linear[l]. With a `head` (else NULL), every row's logits
 * follow in the same call: the final norm and the lm_head as the per-module path calls them (ct_rms_norm,
 * ct_linear's float32 rows). The Python between the layers and the lm_head ran cache-cold after the
 * layers' weight stream (bench/step_phases.py, SmolLM2 bfloat16 on a 2-core Zen 4: the forward's rest
 * 0.49 -> 0.28 ms a token). */
void ct_decode_layers(void *x, int64_t t_rows, int64_t layers, const CtLayer *layer, const CtShape *shape,
                      const CtStepKeys *keys, const CtLinearIO *linear, const CtHead *head, int bf, int wt,
                      int64_t threads) {
    Step s = {shape->hidden, shape->heads, shape->kv_heads, shape->head_dim, shape->intermediate, shape->gated,
              shape->zero_centred, shape->key_heads, shape->value_heads, shape->key_dim, shape->value_dim,
              shape->conv_kernel, keys->rot, t_rows, keys->items, threads, shape->eps, shape->l2_eps, keys->scale,
              bf, wt};
    int64_t size = bf ? 2 : 4, t = t_rows, hidden = s.hidden, value_n = s.hv * s.vd;
    int64_t conv_n = 2 * s.hk * s.kd + value_n, att_n = s.hq * s.d;
    int64_t proj_n = att_n * (s.gated ? 2 : 1) + 2 * s.hkv * s.d, gdn_n = conv_n + value_n + 2 * s.hv;
    int64_t mix_n = att_n > value_n ? att_n : value_n;
    if (gdn_n > proj_n) proj_n = gdn_n;
#define ROWS(width) malloc((size_t)(t * (width) * size))
    Scratch sc = {
        .normed = ROWS(hidden), .proj = ROWS(proj_n), .att = ROWS(mix_n), .gated = ROWS(mix_n),
        .mixed = ROWS(hidden), .total = ROWS(hidden), .gate_up = ROWS(2 * s.inter), .act = ROWS(s.inter),
        .down = ROWS(hidden), .qn = ROWS(att_n), .kn = ROWS(s.hkv * s.d),
        .att_f = malloc((size_t)(t * mix_n) * sizeof(float)),
    };
#undef ROWS
    for (int64_t l = 0; l < layers; l++) {
        const CtLayer *w = &layer[l];
        /* the norms and SiLU x up on the helper team, as the products around them */
        NormJob in = {x, NULL, w->in_norm, NULL, sc.normed, hidden, 0, hidden, s.eps, s.zero_centred, bf};
        parallel_for(norm_rows, &in, t, ROW_GRAIN, threads, 1);
        if (w->kv_slot >= 0)
            attention_mixer(&s, w, keys, &sc);
        else
            gdn_mixer(&s, w, &linear[l], &sc);
        NormJob post = {x, sc.mixed, w->post_norm, sc.total, sc.normed, hidden, hidden, hidden, s.eps,
                        s.zero_centred, bf};
        parallel_for(norm_rows, &post, t, ROW_GRAIN, threads, 1);
        layer_linear(&s, &w->gate_up, sc.normed, hidden, sc.gate_up, 2 * s.inter);
        SiluJob act = {sc.gate_up, sc.act, 2 * s.inter, s.inter, bf};
        parallel_for(silu_rows, &act, t, ROW_GRAIN, threads, 1);
        layer_linear(&s, &w->down, sc.act, s.inter, sc.down, hidden);
        for (int64_t i = 0; i < t * hidden; i++) store(x, i, load(sc.total, i, bf) + load(sc.down, i, bf), bf);
    }
    if (head) {
        NormJob last = {x, NULL, head->norm, NULL, sc.normed, hidden, 0, hidden, s.eps, s.zero_centred, bf};
        parallel_for(norm_rows, &last, t, ROW_GRAIN, threads, 1);
        ct_linear(sc.normed, hidden, head->linear.weight, head->linear.scale, head->linear.bias, head->logits,
                  head->vocab, t, head->vocab, hidden, bf, (int)head->wt, 1, threads);
    }
    char *buffers[] = {sc.normed, sc.proj, sc.att, sc.gated, sc.mixed, sc.total, sc.gate_up, sc.act, sc.down,
                       sc.qn, sc.kn, (char *)sc.att_f};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++) free(buffers[i]);
}

/* ---- prefill attention (bfloat16, AVX-512 BF16) -----------------------------------------------
 * Many query rows of one item over one key run: the torch path's partial attention, where torch's
 * CPU flash kernel multiplies bfloat16 through MKL, which on CPUs other than Intel's widens to float32
 * AVX2 code (~115 GFLOP/s on two Zen 4 cores, where VDPBF16PS runs oneDNN's bfloat16 GEMMs at ~440).
 * A task is one key head and a block of token rows: its G query heads per token (grouped-query
 * attention) are the tile's rows, so each key is packed once for all of them. Per block of
 * CHUNK keys: scores by VDPBF16PS over the head dimension's bfloat16 pairs (keys packed so
 * one vector holds 16 keys' pair p), the online softmax in float32, and P V by VDPBF16PS too: P
 * rounded to bfloat16 (as torch's flash kernel rounds it; its sum stays float32) and the values
 * packed in pairs of keys. Float32 P V (four FMAs per query row and key at head size 64) held the
 * kernel at ~1.5x the flash kernel's time; in pairs it is twice the multiply-adds per instruction:
 * a 2048-token bfloat16 prefill's attention layers 1.18-1.27 -> 0.67-0.68 s, the prefill 696-738 ->
 * 1018-1042 tokens/s (2-core Zen 4, alternating processes). Blocks of 64 keys rather than 32 (half the
 * softmax's reductions per key, four score accumulators per row) and scores six rows per pass (24
 * accumulators): the attention of a 2048-token prefill's chunks 0.64 -> 0.53 s.
 * Float32 runs take the same tasks in float32 FMAs: scores six rows per pass over keys packed 16 to a
 * vector per channel (kp[e * CHUNK + c]), P V four rows per pass over the value rows as they are, P
 * unrounded: where torch's flash kernel would be given an explicit mask (a chunk's causal run with
 * grouped query heads folded into rows) and compute the hidden half too. Built where the bfloat16
 * kernel is (the softmax's helpers are). */
#if LINEAR_BF16_PAIRS
#define PREFILL_ATTENTION 1

#define PREFILL_TILE 48 /* query rows (tokens x heads of a key head) a task aims for */


/* 2^x on 16 lanes for x <= 0: x = n + f with f in [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial
   (relative error below 1.3e-7, float32 rounding's order), 2^n by VSCALEFPS (0 far below -126). Nine
   vector operations where exp16 takes sixteen: the prefill softmax's exponent needs no clamp (its
   x <= 0) and takes the scale and log2(e) in one multiply-subtract. */
static inline __m512 exp2_16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.5403530e-4f), f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define PREFILL_PAIRS (CHUNK / 2)

/* The prefill's online softmax over a block of CHUNK raw dot products per query row (s, row r at
   s + r CHUNK), row r seeing the first visible[r] (0 for a later token's block) of them, 16 rows at a
   time, softmax_chunk's results within float32 rounding: each row's new running max m[r] (of the scaled
   scores: the max over raw ones times scale, which scale > 0 keeps in order); the rescales of what came
   before, exp(m_old - m_new), 16 rows a vector (per row, the scalar exponential's dependent chain
   outweighed the row's vector work); then per row p = exp(s scale - m) by exp2_16 (scale and log2(e)
   in one multiply-subtract) written straight to pb as bfloat16 pairs (0 past visible; P V takes them
   rounded, as torch's flash kernel does), their float32 sum into l. pb NULL (a float32 run): p in
   place of s, unrounded. The 16 rows' maxima and sums come out of their 16-lane partials by fold16x16
   (the same pairing of lanes as _mm512_reduce_max_ps / _add_ps, so the same bits; a row's reduction
   was a dependent chain of shuffles: the attention of a 512-token chunk over 2048 keys 1.025x, over
   512 1.01x, bench/prefill_attention.py's shapes on two Zen 4 cores, alternating in one process). */
static void prefill_softmax(float *s, const int64_t *visible, int64_t rows, float scale, float *m,
                            float *l, float *rescale, uint32_t *pb) {
    const __m512 k2 = _mm512_set1_ps(scale * 1.44269504f);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        int64_t n = rows - r0 < 16 ? rows - r0 : 16;
        __mmask16 in = lanes_below(n), seen = 0;
        v16 part[16];
        for (int64_t i = 0; i < 16; i++) { /* each row's maximum over the keys it sees, folded below */
            __m512 top16 = _mm512_set1_ps(-INFINITY);
            int64_t r = r0 + i, vis = i < n ? visible[r] : 0;
            for (int64_t x = 0; x < vis; x += 16)
                top16 = _mm512_mask_max_ps(top16, lanes_below(vis - x), top16, _mm512_loadu_ps(s + r * CHUNK + x));
            if (vis) seen |= (__mmask16)(1u << i);
            part[i] = (v16)top16;
        }
        __m512 m0 = _mm512_maskz_loadu_ps(in, m + r0);
        __m512 t = _mm512_mask_mul_ps(m0, seen, (__m512)fold16x16(part, FOLD_MAX), _mm512_set1_ps(scale));
        __m512 m1 = _mm512_max_ps(t, m0); /* (t NaN: m, as the scalar comparison keeps it) */
        /* exp16 takes -inf (a first block's m) to 0; a row that sees none of this block keeps its sum */
        _mm512_mask_storeu_ps(rescale + r0, in, _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), seen, exp16(_mm512_sub_ps(m0, m1))));
        _mm512_mask_storeu_ps(m + r0, in, m1);
        for (int64_t i = 0; i < 16; i++) {
            __m512 sum16 = _mm512_setzero_ps();
            part[i] = (v16)sum16;
            if (i >= n) continue;
            int64_t r = r0 + i, vis = visible[r];
            uint32_t *pr = pb ? pb + r * PREFILL_PAIRS : NULL;
            float *sr = s + r * CHUNK;
            if (vis == 0) { /* (row r saw keys before this block: m is finite) */
                if (pr)
                    memset(pr, 0, PREFILL_PAIRS * sizeof(uint32_t));
                else
                    memset(sr, 0, CHUNK * sizeof(float));
                continue;
            }
            const __m512 t2 = _mm512_set1_ps(m[r] * 1.44269504f);
            for (int64_t x = 0; x < CHUNK; x += 32) {
                __m512 p0 = _mm512_maskz_mov_ps(lanes_below(vis - x),
                                                exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + x), k2, t2)));
                __m512 p1 = _mm512_maskz_mov_ps(lanes_below(vis - x - 16),
                                                exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + x + 16), k2, t2)));
                sum16 = _mm512_add_ps(sum16, _mm512_add_ps(p0, p1));
                if (pr) {
                    _mm512_storeu_si512(pr + x / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                } else {
                    _mm512_storeu_ps(sr + x, p0);
                    _mm512_storeu_ps(sr + x + 16, p1);
                }
            }
            part[i] = (v16)sum16;
        }
        __m512 l0 = _mm512_maskz_loadu_ps(in, l + r0), r1 = _mm512_maskz_loadu_ps(in, rescale + r0);
        _mm512_mask_storeu_ps(l + r0, in, _mm512_add_ps(_mm512_mul_ps(l0, r1), (__m512)fold16x16(part, FOLD_ADD)));
    }
}

/* channels e0 .. e0 + 16 REGS of nr <= 4 rows of o (row stride d): o * rescale + sum_c p[c] v[c] over
   the block's key pairs (p 0 where a row does not see the key): p as bfloat16 pairs pb[i * PAIRS + c2],
   the values as pairs of keys vp[c2 * d + e]; REGS constant after inlining */
static inline __attribute__((always_inline)) void prefill_values_regs(float *o, const uint32_t *pb,
                                                                      const float *rescale, const uint32_t *vp,
                                                                      int64_t pairs, int64_t d, int64_t e0,
                                                                      const int nr, const int regs) {
    __m512 acc[4][4];
    for (int i = 0; i < nr; i++) {
        __m512 a = _mm512_set1_ps(rescale[i]);
        for (int u = 0; u < regs; u++) acc[i][u] = _mm512_mul_ps(_mm512_loadu_ps(o + i * d + e0 + 16 * u), a);
    }
    for (int64_t c = 0; c < pairs; c++) {
        __m512bh vv[4];
        for (int u = 0; u < regs; u++) vv[u] = (__m512bh)_mm512_loadu_si512(vp + c * d + e0 + 16 * u);
        for (int i = 0; i < nr; i++) {
            __m512bh pc = (__m512bh)_mm512_set1_epi32((int)pb[i * PREFILL_PAIRS + c]);
            for (int u = 0; u < regs; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], vv[u], pc);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < regs; u++) _mm512_storeu_ps(o + i * d + e0 + 16 * u, acc[i][u]);
}

/* channels e0 .. e0 + 16 REGS of NR <= 4 rows of o (row stride d): o * rescale + sum_c p[c] v[c] over
   a float32 block's n keys in order (p: row i at p + i CHUNK; the value rows v + c vs) */
static inline __attribute__((always_inline)) void values_rows_f32(float *o, const float *p, const float *rescale,
                                                                  const float *v, int64_t vs, int64_t n, int64_t d,
                                                                  int64_t e0, const int nr, const int regs) {
    __m512 acc[4][4];
    for (int i = 0; i < nr; i++) {
        __m512 a = _mm512_set1_ps(rescale[i]);
        for (int u = 0; u < regs; u++) acc[i][u] = _mm512_mul_ps(_mm512_loadu_ps(o + i * d + e0 + 16 * u), a);
    }
    for (int64_t c = 0; c < n; c++) {
        __m512 vv[4];
        for (int u = 0; u < regs; u++) vv[u] = _mm512_loadu_ps(v + c * vs + e0 + 16 * u);
        for (int i = 0; i < nr; i++) {
            __m512 pc = _mm512_set1_ps(p[i * CHUNK + c]);
            for (int u = 0; u < regs; u++) acc[i][u] = _mm512_fmadd_ps(pc, vv[u], acc[i][u]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < regs; u++) _mm512_storeu_ps(o + i * d + e0 + 16 * u, acc[i][u]);
}

/* o <- o rescale + P V for `rows` rows of o [rows, d] over a block's n keys, four rows per pass over the
   values: bfloat16 (bf: p the rows' P in bfloat16 pairs, PREFILL_PAIRS a row, v the block's values in
   pairs of keys) or float32 (p the rows' P, CHUNK a row, v the block's first value row, rows vs apart) */
static void block_values(float *o, const void *p, const float *rescale, const void *v, int64_t vs, int64_t n,
                         int64_t d, int64_t rows, int bf) {
#define PV(NR, REGS)                                                                                          \
    (bf ? prefill_values_regs(o + r0 * d, (const uint32_t *)p + r0 * PREFILL_PAIRS, rescale + r0, v, (n + 1) / 2, \
                              d, e0, NR, REGS)                                                                 \
        : values_rows_f32(o + r0 * d, (const float *)p + r0 * CHUNK, rescale + r0, v, vs, n, d, e0, NR, REGS))
#define PV_ROWS(REGS) \
    switch (nr) { case 4: PV(4, REGS); break; case 3: PV(3, REGS); break; case 2: PV(2, REGS); break; default: PV(1, REGS); }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        int64_t nr = rows - r0 < 4 ? rows - r0 : 4, e0 = 0;
        for (; e0 + 64 <= d; e0 += 64) PV_ROWS(4)
        for (; e0 < d; e0 += 16) PV_ROWS(1)
    }
#undef PV_ROWS
#undef PV
}

typedef struct {
    const void *q, *k, *v; /* bfloat16, or float32 (bf 0) */
    int bf;
    int64_t qs, ks, vs, t, hq, hkv, d, keys, tokens;  /* tokens: token rows per task */
    int causal;
    float scale;
    float *out, *lse;
    /* the run's keys and values, prepared once for every task: per key head and block of CHUNK
       keys, the keys' bfloat16 pairs kp[p * CHUNK + c] and the values of key pairs c2 = c / 2,
       vp[c2 * d + e] = (v[2 c2][e], v[2 c2 + 1][e]); float32: the keys per channel kp[e * CHUNK + c]
       (as floats), the values read where they are (vp NULL) */
    uint32_t *kp, *vp;
    int64_t blocks;  /* key blocks per head */
} PrefillJob;

/* key blocks begin .. end-1 (over heads) of a PrefillJob: keys and values packed in pairs, zeros past the
   run's last key */
static void prefill_pack(void *ctx, int64_t begin, int64_t end) {
    const PrefillJob *j = ctx;
    int64_t d = j->d, pairs = d / 2;
    if (!j->bf) { /* float32 keys per channel */
        for (int64_t b = begin; b < end; b++) {
            int64_t h = b / j->blocks, k0 = (b % j->blocks) * CHUNK;
            float *kp = (float *)j->kp + b * d * CHUNK;
            for (int64_t c = 0; c < CHUNK; c++) {
                if (k0 + c < j->keys) {
                    const float *kr = (const float *)j->k + (k0 + c) * j->ks + h * d;
                    for (int64_t e = 0; e < d; e++) kp[e * CHUNK + c] = kr[e];
                } else {
                    for (int64_t e = 0; e < d; e++) kp[e * CHUNK + c] = 0.0f;
                }
            }
        }
        return;
    }
    for (int64_t b = begin; b < end; b++) {
        int64_t h = b / j->blocks, k0 = (b % j->blocks) * CHUNK;
        int64_t c = j->keys - k0 < CHUNK ? j->keys - k0 : CHUNK;
        const char *kr[CHUNK], *vr[CHUNK];
        for (int64_t x = 0; x < c; x++) {
            kr[x] = (const char *)((const bf16 *)j->k + (k0 + x) * j->ks + h * d);
            vr[x] = (const char *)((const bf16 *)j->v + (k0 + x) * j->vs + h * d);
        }
        pack_block(kr, vr, c, d, j->kp + b * pairs * CHUNK, j->vp + b * PREFILL_PAIRS * d);
    }
}

static void prefill_task(const PrefillJob *j, int64_t task, float *s, uint32_t *pb, float *o, float *m,
                         float *l, float *rescale) {
    int64_t g = j->hq / j->hkv, d = j->d, pairs = d / 2, blocks = (j->t + j->tokens - 1) / j->tokens;
    int64_t h = task / blocks, t0 = (task % blocks) * j->tokens;
    int64_t t1 = t0 + j->tokens < j->t ? t0 + j->tokens : j->t, rows = (t1 - t0) * g;
    int64_t shift = j->keys - j->t; /* causal: token t sees keys 0 .. shift + t */
    int64_t end = j->causal ? shift + t1 : j->keys;
    const void *qrows[rows]; /* query row r: token t0 + r / g, head h g + r % g */
    int64_t visible[rows], size = j->bf ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        qrows[r] = (const char *)j->q + ((t0 + r / g) * j->qs + (h * g + r % g) * d) * size;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + r * d, 0, (size_t)d * sizeof(float));
    }
    for (int64_t k0 = 0; k0 < end; k0 += CHUNK) {
        int64_t n = end - k0 < CHUNK ? end - k0 : CHUNK, block = h * j->blocks + k0 / CHUNK;
        chunk_scores(qrows, rows, j->kp + block * (j->bf ? pairs : d) * CHUNK, j->bf ? pairs : d, s, j->bf);
        for (int64_t r = 0; r < rows; r++) { /* keys of this block row r sees */
            int64_t v = j->causal ? shift + t0 + r / g + 1 - k0 : n;
            visible[r] = v > n ? n : (v < 0 ? 0 : v);
        }
        prefill_softmax(s, visible, rows, j->scale, m, l, rescale, j->bf ? pb : NULL);
        if (j->bf)
            block_values(o, pb, rescale, j->vp + block * PREFILL_PAIRS * d, 0, n, d, rows, 1);
        else
            block_values(o, s, rescale, (const float *)j->v + k0 * j->vs + h * d, j->vs, n, d, rows, 0);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = t0 + r / g, head = h * g + r % g;
        float inv = 1.0f / l[r], *dst = j->out + (t * j->hq + head) * d;
        for (int64_t e = 0; e < d; e++) dst[e] = o[r * d + e] * inv;
        j->lse[t * j->hq + head] = m[r] + logf(l[r]);
    }
}

static void prefill_tasks(void *ctx, int64_t begin, int64_t end) {
    const PrefillJob *j = ctx;
    int64_t rows = j->tokens * (j->hq / j->hkv), d = j->d;
    float *s = malloc((size_t)(rows * CHUNK) * sizeof(float));
    uint32_t *pb = malloc((size_t)(rows * PREFILL_PAIRS) * sizeof(uint32_t));
    float *o = malloc((size_t)(rows * d) * sizeof(float));
    float *m = malloc((size_t)rows * sizeof(float)), *l = malloc((size_t)rows * sizeof(float));
    float *rescale = malloc((size_t)rows * sizeof(float));
    for (int64_t i = begin; i < end; i++) prefill_task(j, i, s, pb, o, m, l, rescale);
    free(rescale);
    free(pb);
    free(s);
    free(o);
    free(m);
    free(l);
}
#else
#define PREFILL_ATTENTION 0
#endif

/* Whether ct_prefill_attention is built here (with the bfloat16 pairs: AVX-512 BF16), for both dtypes */
int ct_prefill_attention_built(void) { return PREFILL_ATTENTION; }

#if PREFILL_ATTENTION
/* The queries rotated for the run (cos, sin: Rotary.prepare's tables, [T, rot] of q's dtype), as
   Rotary.apply_prepared rotates them (`rotate`: each product rounded to the dtype), into a contiguous
   copy: tokens begin .. end-1 */
typedef struct {
    const char *q;
    int64_t qs, hq, d, rot;
    const char *cos, *sin;
    char *out;
    int bf;
} PrefillRotation;

static void prefill_rotate(void *ctx, int64_t begin, int64_t end) {
    const PrefillRotation *j = ctx;
    float x[j->d], y[j->d];
    int64_t size = j->bf ? 2 : 4;
    for (int64_t t = begin; t < end; t++)
        for (int64_t h = 0; h < j->hq; h++) {
            load_row(j->q + (t * j->qs + h * j->d) * size, j->d, j->bf, x);
            rotate(x, j->d, j->rot, j->cos + t * j->rot * size, j->sin + t * j->rot * size, j->bf, y);
            store_row(j->out + (t * j->hq + h) * j->d * size, y, j->d, j->bf);
        }
}
#endif

/* Attention of q [T, Hq, D] (token stride qs; heads contiguous, D apart) over one run of `keys` keys
 * and values k, v [L, Hkv, D] (key strides ks, vs), all bfloat16 (bf) or all float32, into out
 * [T, Hq, D] and lse [T, Hq] float32 (natural log). With cos and sin (not NULL: Rotary.prepare's
 * tables [T, rot] of the same dtype), q is rotated for the run first, as Rotary.apply_prepared rotates it (the torch ops it
 * spares: five per layer and run); else q comes rotated. `causal`: L >= T and token t sees keys
 * 0 .. L-T+t; else every token sees all L. Tasks (key head, block of tokens) split over up to `threads`
 * threads. D is a multiple of 16 (Python checks). Where not built (PREFILL_ATTENTION 0) it does
 * nothing: Python never calls it. */
void ct_prefill_attention(const void *q, int64_t qs, const void *k, int64_t ks, const void *v, int64_t vs,
                          const void *cos, const void *sin, int64_t rot, int64_t t, int64_t hq, int64_t hkv,
                          int64_t d, int64_t keys, int causal, float scale, float *out, float *lse, int bf,
                          int64_t threads) {
#if PREFILL_ATTENTION
    int64_t g = hq / hkv, tokens = PREFILL_TILE / g > 0 ? PREFILL_TILE / g : 1;
    int64_t blocks = (keys + CHUNK - 1) / CHUNK;
    char *rotated = NULL;
    if (cos) {
        rotated = malloc((size_t)(t * hq * d) * (bf ? 2 : 4));
        PrefillRotation rj = {q, qs, hq, d, rot, cos, sin, rotated, bf};
        parallel_for(prefill_rotate, &rj, t, 16, threads, 0);
        q = rotated, qs = hq * d;
    }
    /* bfloat16: keys and values in pairs; float32: keys per channel (d floats per key), values as they are */
    PrefillJob job = {q, k, v, bf, qs, ks, vs, t, hq, hkv, d, keys, tokens, causal, scale, out, lse,
                      malloc((size_t)(hkv * blocks * CHUNK * d / (bf ? 2 : 1)) * sizeof(uint32_t)),
                      bf ? malloc((size_t)(hkv * blocks * PREFILL_PAIRS * d) * sizeof(uint32_t)) : NULL, blocks};
    parallel_for(prefill_pack, &job, hkv * blocks, 4, threads, 0);
    parallel_for(prefill_tasks, &job, hkv * ((t + tokens - 1) / tokens), 1, threads, 0);
    free(job.kp);
    free(job.vp);
    free(rotated);
#else
    (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)cos, (void)sin, (void)rot, (void)t;
    (void)hq, (void)hkv, (void)d, (void)keys, (void)causal, (void)scale, (void)out, (void)lse, (void)bf;
    (void)threads;
#endif
}
