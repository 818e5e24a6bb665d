/* cothink's fused CPU kernels for decode-sized work, called through ctypes (cothink/ops/native.py).
 *
 * A decode step spends more time dispatching small torch ops than computing them: an RMSNorm is
 * eight ops (~18 us for one row), a view attention of one query ~200 us of which the kernel is ~40.
 * Each function here does one of those units in a single call, single-threaded (no OpenMP: a second
 * OpenMP runtime next to torch's would fight it for the cores).
 *
 * Tensors arrive as data pointers with their row strides (elements); the last dimension is always
 * contiguous. `bf` selects the storage type: 0 float32, 1 bfloat16. Arithmetic is float32, and every
 * rounding the torch path makes to the model dtype is made here too (`rnd`), so for float32 the
 * element-wise kernels match torch to the bit and for bfloat16 to its rounding of a float result.
 * Built with -ffp-contract=off so that a*b + c*d is never fused into one rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Rotary embedding of one head x[d] with prepared tables (cos, sign-folded sin) over the first `rot`
 * channels, as Rotary.apply_prepared: x*cos + roll(x, rot/2)*sin, each product rounded to the dtype. */
static void rotate(const float *x, int64_t d, int64_t rot, const void *cos, const void *sin, int bf,
                   float *out) {
    int64_t half = rot / 2;
    float c[rot], s[rot], partner[rot]; /* partner[i] = x[(i + half) % rot], without a division */
    load_row(cos, rot, bf, c);
    load_row(sin, rot, bf, s);
    memcpy(partner, x + half, (size_t)half * sizeof(float));
    memcpy(partner + half, x, (size_t)half * sizeof(float));
    for (int64_t i = 0; i < rot; i++) out[i] = x[i] * c[i];
    for (int64_t i = 0; i < rot; i++) partner[i] *= s[i];
    round_row(out, rot, bf);
    round_row(partner, rot, bf);
    for (int64_t i = 0; i < rot; i++) out[i] += partner[i];
    round_row(out, rot, bf);
    for (int64_t i = rot; i < d; i++) out[i] = x[i];
}

/* Sums of 16 lanes: the loops vectorise without reassociating (no -ffast-math), and the lanes are
 * folded as a tree (8+8, 4+4, ...) rather than one after another, a chain 4 adds long, not 16. */
static inline float fold16(float *acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[16] = {0};
    int64_t body = d - d % 16;
    for (int64_t i = 0; i < body; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    for (int64_t i = body; i < d; i++) acc[i - body] += a[i] * b[i];
    return fold16(acc);
}

static inline float sum(const float *x, int64_t n) {
    float acc[16] = {0};
    int64_t body = n - n % 16;
    for (int64_t i = 0; i < body; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j];
    for (int64_t i = body; i < n; i++) acc[i - body] += x[i];
    return fold16(acc);
}

/* RMSNorm of `rows` rows of x (row stride xs), optionally after adding a residual: s = x + res
 * (rounded to the dtype, written to sum_out), out = norm(s). Llama/Qwen3 scale after the cast
 * (w * dtype(normed)); zero-centred (Qwen3.5) scales in float by (1 + w), then casts. */
void ct_rms_norm(const void *x, int64_t xs, const void *res, int64_t rs, void *sum_out, const void *w,
                 void *out, int64_t rows, int64_t dim, float eps, int zero_centred, int bf) {
    float *s = malloc((size_t)dim * sizeof(float));
    float *wf = malloc((size_t)dim * sizeof(float));
    load_row(w, dim, bf, wf);
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * xs * (bf ? 2 : 4);
        load_row(xr, dim, bf, s);
        if (res) {
            const char *rr = (const char *)res + r * rs * (bf ? 2 : 4);
            for (int64_t i = 0; i < dim; i++) {
                s[i] = rnd(s[i] + load(rr, i, bf), bf);
                store(sum_out, r * dim + i, s[i], bf);
            }
        }
        double ss = 0.0;
        for (int64_t i = 0; i < dim; i++) ss += (double)s[i] * s[i];
        float inv = 1.0f / sqrtf((float)(ss / (double)dim) + eps);
        for (int64_t i = 0; i < dim; i++) {
            float normed = s[i] * inv;
            float y = zero_centred ? normed * (1.0f + wf[i]) : wf[i] * rnd(normed, bf);
            store(out, r * dim + i, y, bf);
        }
    }
    free(s);
    free(wf);
}

/* silu(gate) * up for rows of gate_up = [gate | up] (row stride gs, `inter` channels each);
 * silu is rounded to the dtype before the product, as torch computes F.silu(gate) * up. */
void ct_silu_mul(const void *gate_up, int64_t gs, void *out, int64_t rows, int64_t inter, int bf) {
    int64_t size = bf ? 2 : 4;
    float *g = malloc((size_t)inter * sizeof(float)), *u = malloc((size_t)inter * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        load_row((const char *)gate_up + r * gs * size, inter, bf, g);
        load_row((const char *)gate_up + (r * gs + inter) * size, inter, bf, u);
        for (int64_t i = 0; i < inter; i++) g[i] = g[i] / (1.0f + fast_exp(-g[i]));
        round_row(g, inter, bf);
        for (int64_t i = 0; i < inter; i++) g[i] *= u[i];
        store_row((char *)out + r * inter * size, g, inter, bf);
    }
    free(g);
    free(u);
}

/* Rotate this step's keys k [T, H, D] (row stride ks) with per-row tables cos/sin [T, rot] and write
 * them, with the values v [T, H, D] (row stride vs), to pool slots slots[t] of one layer's
 * pool_k/pool_v [S, H, D]. */
void ct_store_kv(const void *k, int64_t ks, const void *v, int64_t vs, const int64_t *slots, int64_t t_rows,
                 int64_t heads, int64_t d, int64_t rot, const void *cos, const void *sin, void *pool_k,
                 void *pool_v, int bf) {
    int64_t size = bf ? 2 : 4;
    float *x = malloc((size_t)d * sizeof(float)), *y = malloc((size_t)d * sizeof(float));
    for (int64_t t = 0; t < t_rows; t++) {
        int64_t slot = slots[t];
        const char *c = (const char *)cos + t * rot * size, *s = (const char *)sin + t * rot * size;
        for (int64_t h = 0; h < heads; h++) {
            load_row((const char *)k + (t * ks + h * d) * size, d, bf, x);
            rotate(x, d, rot, c, s, bf, y);
            for (int64_t i = 0; i < d; i++) store(pool_k, (slot * heads + h) * d + i, y[i], bf);
        }
        memcpy((char *)pool_v + slot * heads * d * size, (const char *)v + t * vs * size,
               (size_t)(heads * d * size));
    }
    free(x);
    free(y);
}

/* Attention of single-query items over their views, one call for all of them.
 *
 * Item i's query is row rows[i] of q [T, Hq, D] (row stride qs, head stride qh). It reads the key
 * runs run_start[i] .. run_start[i+1]-1; run r is the pool slots slots[key_start[r] .. key_start[r+1])
 * and rotates the query with its own tables cos/sin [R, rot] (the query's position relative to the
 * run's block; keys carry block-local RoPE). All runs of an item form one softmax, which is what the
 * log-sum-exp merge of per-run partials computes. out [T, Hq, D] float32, row rows[i] written.
 * `longest` is the longest run, for the score buffer. */
void ct_decode_attention(const void *q, int64_t qs, int64_t qh, int64_t hq, int64_t hkv, int64_t d,
                         int64_t rot, int64_t items, const int64_t *rows, const int64_t *run_start,
                         const int64_t *key_start, const int64_t *slots, const void *cos, const void *sin,
                         const void *pool_k, const void *pool_v, float scale, int64_t longest, float *out,
                         int bf) {
    int64_t g = hq / hkv, size = bf ? 2 : 4;
    float *qf = malloc((size_t)(g * d) * sizeof(float)), *qr = malloc((size_t)(g * d) * sizeof(float));
    float *kf = malloc((size_t)d * sizeof(float)), *acc = malloc((size_t)(g * d) * sizeof(float));
    float *scores = malloc((size_t)(g * (longest > 0 ? longest : 1)) * sizeof(float));
    float m[64], l[64]; /* per query head of the group; Python checks g <= 64 */
    for (int64_t i = 0; i < items; i++) {
        int64_t row = rows[i];
        for (int64_t kh = 0; kh < hkv; kh++) {
            for (int64_t j = 0; j < g; j++) {
                load_row((const char *)q + (row * qs + (kh * g + j) * qh) * size, d, bf, qf + j * d);
                m[j] = -INFINITY;
                l[j] = 0.0f;
            }
            memset(acc, 0, (size_t)(g * d) * sizeof(float));
            for (int64_t r = run_start[i]; r < run_start[i + 1]; r++) {
                int64_t a = key_start[r], n = key_start[r + 1] - a;
                if (n == 0) continue;
                const char *c = (const char *)cos + r * rot * size, *s = (const char *)sin + r * rot * size;
                for (int64_t j = 0; j < g; j++) rotate(qf + j * d, d, rot, c, s, bf, qr + j * d);
                for (int64_t x = 0; x < n; x++) {
                    load_row((const char *)pool_k + ((slots[a + x] * hkv + kh) * d) * size, d, bf, kf);
                    for (int64_t j = 0; j < g; j++) scores[j * n + x] = dot(qr + j * d, kf, d) * scale;
                }
                for (int64_t j = 0; j < g; j++) {
                    float top = m[j], *sj = scores + j * n;
                    for (int64_t x = 0; x < n; x++) top = sj[x] > top ? sj[x] : top;
                    float rescale = fast_exp(m[j] - top); /* 0 for the first run (m = -inf) */
                    l[j] *= rescale;
                    for (int64_t e = 0; e < d; e++) acc[j * d + e] *= rescale;
                    m[j] = top;
                    for (int64_t x = 0; x < n; x++) sj[x] = fast_exp(sj[x] - top);
                    l[j] += sum(sj, n);
                }
                for (int64_t x = 0; x < n; x++) {
                    load_row((const char *)pool_v + ((slots[a + x] * hkv + kh) * d) * size, d, bf, kf);
                    for (int64_t j = 0; j < g; j++) {
                        float p = scores[j * n + x], *o = acc + j * d;
                        for (int64_t e = 0; e < d; e++) o[e] += p * kf[e];
                    }
                }
            }
            for (int64_t j = 0; j < g; j++) {
                float *o = out + (row * hq + kh * g + j) * d;
                for (int64_t e = 0; e < d; e++) o[e] = acc[j * d + e] / l[j];
            }
        }
    }
    free(qf);
    free(qr);
    free(kf);
    free(acc);
    free(scores);
}
