/* Decode attention on the CPU in one call: a few queries per row (a decode step, a speculative
   verification) against one or more parts of keys (a shared prefix held once, each row's own
   tail), softmax over their concatenation. Built and bound by backends/cpu/native_attention.py.

   Per (row, KV head): every key is read once for the head group's queries; scores go to a
   scratch row per query; one max, one exp pass (the Cephes 2**f polynomial MLX's CPU exp uses,
   as backends/cpu/fast_math.py), one pass over the values. A query that sees no key gives 0 (a free
   slab row), as backends/cascade.py's attend_parts does. Each row is computed on its own in a fixed
   order: its result does not depend on which other rows share the call. A part's keys / values may
   also be mx.quantize's codes (a QuantizedKVCache, KV_BITS uniform): each block of them is
   dequantised into a scratch block first, exactly as mx.dequantize does (code * scale + bias, two
   roundings), and attended as floats. Part of native/kernels.c. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TB 32        /* keys per block: the query loop runs inside a block that stays in L1 */
#define MAXQ 64      /* queries per (row, KV head): heads per group x query length */
#define MAXD 256

typedef struct {                      /* one array of a [B | 1, H, T, *] buffer: strides in its elements */
    const void *p;
    int64_t b, h, t;
} view_t;

typedef struct {
    const float *k, *v;
    int64_t kb, kh, kt, vb, vh, vt;   /* strides in floats; kb == 0: one copy for every row */
    int64_t T;
    const void *mask;                 /* NULL, or float (additive) / uint8 (1 = visible) */
    int64_t mask_is_bool;
    int64_t mb, mh, ml, mt;           /* mask strides in elements (0: broadcast) */
    int64_t causal;                   /* the queries are the last L of the T keys */
    const uint8_t *rows;              /* NULL, or per row: 0 = this part is hidden from the row */
    int64_t bits, group;              /* 0: float k / v; else k / v unused and kq / vq hold mx.quantize's */
    view_t kq[3], vq[3];              /* packed codes (uint32 words), scales, biases (float) */
} part_t;

/* Rows t0..t1-1 of one (row, head) of a quantised array, dequantised into out ([t1 - t0, D]) exactly
   as mx.dequantize: code i of a row sits at bit i * bits of its packed words read little-endian
   (2 / 4 / 8 bits: within one uint32 word; 3 / 5 / 6: 8 codes in ``bits`` bytes), and its value is
   code * scale + bias of its group, the product rounded before the sum -- never one fused
   multiply-add (this function is built without contraction), so the floats are mx.dequantize's
   bit for bit and the same whatever call reads them. Not inlined: its build options differ.
   The codes are unpacked bytewise (code i at bit i * bits, little-endian, for every width). */
#if defined(__clang__)
#define NO_FP_CONTRACT __attribute__((noinline))
#else
#define NO_FP_CONTRACT __attribute__((noinline, optimize("fp-contract=off")))
#endif
NO_FP_CONTRACT static void dequantize(const view_t *q, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t D,
                                      int64_t bits, int64_t group, float *restrict out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const uint32_t mask = (1u << bits) - 1;
    float c[MAXD] __attribute__((aligned(64)));
    for (int64_t t = t0; t < t1; t++, out += D) {
        const uint8_t *by = (const uint8_t *)((const uint32_t *)q[0].p + b * q[0].b + h * q[0].h + t * q[0].t);
        const float *sc = (const float *)q[1].p + b * q[1].b + h * q[1].h + t * q[1].t;
        const float *bi = (const float *)q[2].p + b * q[2].b + h * q[2].h + t * q[2].t;
        if (bits == 8) {
            for (int64_t d = 0; d < D; d++) c[d] = (float)by[d];
        } else if (bits == 4) {
            for (int64_t i = 0; i < D / 2; i++) { c[2 * i] = (float)(by[i] & 15); c[2 * i + 1] = (float)(by[i] >> 4); }
        } else if (bits == 2) {
            for (int64_t i = 0; i < D / 4; i++)
                for (int k = 0; k < 4; k++) c[4 * i + k] = (float)((by[i] >> (2 * k)) & 3);
        } else {
            for (int64_t d = 0; d < D; d++) {
                const int64_t at = d * bits, i = at >> 3, sh = at & 7;
                uint32_t x = by[i];
                if (sh + bits > 8) x |= (uint32_t)by[i + 1] << 8;    /* never a byte past the row */
                c[d] = (float)((x >> sh) & mask);
            }
        }
        for (int64_t g0 = 0; g0 < D; g0 += group) {
            const float s = sc[g0 / group], z = bi[g0 / group];
            for (int64_t d = g0; d < g0 + group; d++) {
                const float prod = c[d] * s;
                out[d] = prod + z;
            }
        }
    }
}

static inline __attribute__((always_inline)) float hsum16(const float *a) {
    float b[8], c[4];
    for (int i = 0; i < 8; i++) b[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b, const int64_t D) {
#ifdef __AVX512F__
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
#else
    float acc[16] = {0};
    for (int64_t d = 0; d < D; d += 16)
        for (int i = 0; i < 16; i++) acc[i] += a[d + i] * b[d + i];
    return hsum16(acc);
#endif
}

static inline __attribute__((always_inline)) float maxv(const float *s, int64_t n) {
    float top = -INFINITY;
    int64_t t = 0;
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
    top = _mm512_reduce_max_ps(m);
#endif
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    return top;
}

/* exp(s - top) in place and its sum. A hidden key (-inf, or an additive mask's large negative)
   becomes exactly 0 and is left out of the sum; the others are summed in 16 lanes by their count
   among the keys with a weight -- for a visible key, its position in the row's sequence (a prefix
   part, then the row's own keys past any left padding, the causal future hidden) -- so a query's
   sum is the same whatever the call's length, a slab row's padding, or how the keys are split into
   parts: a row's attention does not depend on the call it is in (what a position's K / V need under
   KV quantisation: LESSONS 79). The weighted sum over the values runs in key order and adds the
   hidden keys' exact zeros, so it is the same too. */
static void exp_shift(float *restrict s, int64_t n, float top, float *restrict sum) {
    const float c0 = 1.535336188319500e-4f, c1 = 1.339887440266574e-3f, c2 = 9.618437357674640e-3f,
                c3 = 5.550332471162809e-2f, c4 = 2.402264791363012e-1f, c5 = 6.931472028550421e-1f;
    float acc[16] = {0};
    int64_t i = 0, seen = 0;
    for (; i < n; i++) {
        float t = (s[i] - top) * 1.4426950408889634f;
        t = t < -127.f ? -127.f : t;
        float u = t + 12582912.0f;
        float f = t - (u - 12582912.0f);
        float p = ((((((c0 * f + c1) * f + c2) * f + c3) * f + c4) * f + c5) * f + 1.0f);
        int32_t bits;
        memcpy(&bits, &u, 4);
        bits = (bits - (0x4B400000 - 127)) << 23;
        float e;
        memcpy(&e, &bits, 4);
        s[i] = e * p;
    }
    for (i = 0; i < n; i++)
        if (s[i] != 0.f) acc[seen++ & 15] += s[i];
    *sum = hsum16(acc);
}

static inline __attribute__((always_inline)) void body(
        const float *restrict q, int64_t u0, int64_t u1, int64_t Hq, int64_t Hkv, int64_t L, const int64_t D, const int64_t Dv,
        const part_t *parts, int64_t np, float *restrict out, float *restrict S) {
    const int64_t rep = Hq / Hkv, n = rep * L;
    int64_t Tall = 0;
    for (int64_t p = 0; p < np; p++) Tall += parts[p].T;
    const float NEG = -INFINITY;
    float blk[TB * MAXD] __attribute__((aligned(64)));   /* a block of dequantised keys or values */
    for (int64_t u = u0; u < u1; u++) {       /* units: (row, KV head) pairs, u = b * Hkv + g */
        const int64_t b = u / Hkv, g = u % Hkv;
        const float *qg = q + (b * Hq + g * rep) * L * D;     /* n queries, contiguous */
        int64_t off = 0;
        for (int64_t p = 0; p < np; p++) {
            const part_t *P = &parts[p];
            const int64_t T = P->T;
            int64_t last[MAXQ], moff[MAXQ];   /* per query: last visible key, mask offset */
            const int64_t hidden = P->rows && !P->rows[b];
            for (int64_t j = 0; j < n; j++) {
                last[j] = hidden ? -1 : (P->causal ? T - L + j % L : T - 1);
                moff[j] = b * P->mb + (g * rep + j / L) * P->mh + (j % L) * P->ml;   /* no division per key */
            }
            const float *kbase = P->bits ? blk : P->k + b * P->kb + g * P->kh;
            const int64_t kt = P->bits ? D : P->kt;
            for (int64_t t0 = 0; t0 < T; t0 += TB) {          /* a block of keys stays in L1 */
                const int64_t t1 = t0 + TB < T ? t0 + TB : T;
                if (P->bits && !hidden) dequantize(P->kq, b, g, t0, t1, D, P->bits, P->group, blk);
                for (int64_t j = 0; j < n; j++) {
                    const float *qj = qg + j * D, *kp = kbase + (P->bits ? 0 : t0 * kt);
                    float *srow = S + j * Tall + off;
                    for (int64_t t = t0; t < t1; t++, kp += kt) {
                        float s = NEG;
                        if (t <= last[j]) {
                            s = dot(qj, kp, D);
                            if (P->mask) {
                                const int64_t at = moff[j] + t * P->mt;
                                if (P->mask_is_bool) s = ((const uint8_t *)P->mask)[at] ? s : NEG;
                                else s += ((const float *)P->mask)[at];
                            }
                        }
                        srow[t] = s;
                    }
                }
            }
            off += T;
        }
        float den[MAXQ];
        for (int64_t j = 0; j < n; j++) {
            float *s = S + j * Tall, top = maxv(s, Tall);
            if (top == NEG) { memset(s, 0, Tall * sizeof(float)); den[j] = 0.f; continue; }
            exp_shift(s, Tall, top, &den[j]);
        }
        float acc[MAXQ][MAXD] __attribute__((aligned(64)));
        for (int64_t j = 0; j < n; j++) memset(acc[j], 0, Dv * sizeof(float));
        off = 0;
        for (int64_t p = 0; p < np; p++) {
            const part_t *P = &parts[p];
            const float *vbase = P->bits ? blk : P->v + b * P->vb + g * P->vh;
            const int64_t vt = P->bits ? Dv : P->vt;
            const int64_t hidden = P->rows && !P->rows[b];
            for (int64_t t0 = 0; t0 < P->T; t0 += TB) {       /* each (j, d) sums over t in order */
                const int64_t t1 = t0 + TB < P->T ? t0 + TB : P->T;
                if (P->bits) {     /* a hidden part's weights are zeros: its values are never read */
                    if (hidden) continue;
                    dequantize(P->vq, b, g, t0, t1, Dv, P->bits, P->group, blk);
                }
                for (int64_t j = 0; j < n; j++) {
                    const float *w = S + j * Tall + off, *vp = vbase + (P->bits ? 0 : t0 * vt);
                    float *restrict a = acc[j];
                    for (int64_t t = t0; t < t1; t++, vp += vt)
                        for (int64_t d = 0; d < Dv; d++) a[d] += w[t] * vp[d];
                }
            }
            off += P->T;
        }
        for (int64_t j = 0; j < n; j++) {
            float *o = out + ((b * Hq + g * rep) * L + j) * Dv;
            const float inv = den[j] > 0.f ? 1.f / den[j] : 0.f;
            for (int64_t d = 0; d < Dv; d++) o[d] = acc[j][d] * inv;
        }
    }
}

typedef struct {
    const float *q; int64_t u0, u1, Hq, Hkv, L, D, Dv; const part_t *parts; int64_t np; float *out, *S;
} job_t;

static void run(const job_t *j) {
    if (j->D == 64 && j->Dv == 64) body(j->q, j->u0, j->u1, j->Hq, j->Hkv, j->L, 64, 64, j->parts, j->np, j->out, j->S);
    else if (j->D == 128 && j->Dv == 128) body(j->q, j->u0, j->u1, j->Hq, j->Hkv, j->L, 128, 128, j->parts, j->np, j->out, j->S);
    else body(j->q, j->u0, j->u1, j->Hq, j->Hkv, j->L, j->D, j->Dv, j->parts, j->np, j->out, j->S);
}

static void run_task(const void *arg) { run((const job_t *)arg); }

#define SPLIT_MIN 20000   /* query-key products below which a second thread costs more than it saves */

/* 0, or -1 when the shapes are outside what this kernel was built for (the caller falls back).
   ``scratch`` holds ``threads`` areas of ``scratch_each`` floats; with threads == 2 and enough
   work, the second half of the (row, KV head) units runs on the library's helper thread (pool.h;
   each unit's arithmetic is the same either way: one row alone splits over its heads). */
int64_t attend(const float *q, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t D, int64_t Dv,
               const part_t *parts, int64_t np, float *out, float *scratch, int64_t scratch_each, int64_t threads) {
    if (Hkv <= 0 || Hq % Hkv || (Hq / Hkv) * L > MAXQ || Dv > MAXD || D % 16) return -1;
    int64_t Tall = 0;
    for (int64_t p = 0; p < np; p++) Tall += parts[p].T;
    const int64_t units = B * Hkv;
    job_t all = {q, 0, units, Hq, Hkv, L, D, Dv, parts, np, out, scratch};
    if (threads < 2 || units < 2 || B * Hq * L * Tall < SPLIT_MIN) { run(&all); return 0; }
    job_t first = all, second = all;
    first.u1 = second.u0 = (units + 1) / 2;
    second.S = scratch + scratch_each;
    pool_run2(run_task, &first, &second);
    return 0;
}
