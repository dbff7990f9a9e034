/* y[M, N] = x[M, K] @ w[N, K]^T for a few rows (a decode step's projections), reading each
   weight row once from memory, in place (an nn.Linear weight is row-major [out, in]): no
   packing of the weight as a general GEMM does on every call (for 8 rows OpenBLAS spends much of
   a product repacking the weight). Blocks of WROWS weight rows x GROUP x rows keep their
   accumulators in registers; the block's weight rows stay in L1 while further row groups pass.
   Built by backends/cpu/native_products.py with -O3 -march=native (AVX-512, AVX2 + FMA, or portable C).

   Every (row, output) dot product runs the same instruction sequence whatever M is and whichever
   group of rows it falls in: VEC lanes of partial sums over k = lane (mod VEC), the K tail in
   the same lanes, then one fixed-order reduction -- a row's result never depends on the other
   rows of the call (a batched step and a row decoded alone agree bit for bit).

   Two threads (threads == 2): outputs [0, split) on the caller's thread, [split, N) on the
   library's helper thread (pool.h). Part of native/kernels.c. */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload_tail(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_tail(const float *p, int n) {
    float buf[8] = {0};
    memcpy(buf, p, (size_t)n * sizeof(float));
    return _mm256_loadu_ps(buf);
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#else
#define VEC 8
typedef struct { float v[8]; } vf;
static inline vf vzero(void) { vf a; for (int i = 0; i < 8; i++) a.v[i] = 0.0f; return a; }
static inline vf vload(const float *p) { vf a; for (int i = 0; i < 8; i++) a.v[i] = p[i]; return a; }
static inline vf vload_tail(const float *p, int n) { vf a = vzero(); for (int i = 0; i < n; i++) a.v[i] = p[i]; return a; }
static inline vf vfma(vf a, vf b, vf c) { for (int i = 0; i < 8; i++) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]); return c; }
static inline float vsum(vf a) {
    float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
    s0 += s2; s1 += s3;
    return s0 + s1;
}
#endif

/* Each loaded vector used by several FMAs stays in a register: left to itself the compiler folds
   the load into every FMA that uses it (4 loads of the same vector where one would do), and the
   loop is then bound by loads, not by multiply-adds. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

#define GROUP 4        /* x rows per pass over a block of weight rows */
#define WROWS 4        /* weight rows per block: GROUP x WROWS accumulators in registers */

/* Outputs [o0, o0 + W) for rows [r0, r0 + R) (R <= GROUP, W <= WROWS). */
static inline __attribute__((always_inline)) void block(const float *x, int64_t r0, const int R, const float *w,
                                                        int64_t K, int64_t o0, const int W, float *y, int64_t N) {
    vf acc[WROWS][GROUP];
    const float *wr[WROWS];
    for (int i = 0; i < W; i++) {
        wr[i] = w + (o0 + i) * K;
        for (int r = 0; r < R; r++) acc[i][r] = vzero();
    }
    int64_t k = 0;
    for (; k + VEC <= K; k += VEC) {
        vf xr[GROUP];
        for (int r = 0; r < R; r++) { xr[r] = vload(x + (r0 + r) * K + k); if (W > 1) IN_REGISTER(xr[r]); }
        for (int i = 0; i < W; i++) {
            vf u = vload(wr[i] + k);
            if (R > 1) IN_REGISTER(u);       /* one row: the load folds into its only FMA */
            for (int r = 0; r < R; r++) acc[i][r] = vfma(u, xr[r], acc[i][r]);
        }
    }
    if (k < K) {
        int n = (int)(K - k);
        vf xr[GROUP];
        for (int r = 0; r < R; r++) xr[r] = vload_tail(x + (r0 + r) * K + k, n);
        for (int i = 0; i < W; i++) {
            vf u = vload_tail(wr[i] + k, n);
            for (int r = 0; r < R; r++) acc[i][r] = vfma(u, xr[r], acc[i][r]);
        }
    }
    for (int i = 0; i < W; i++)
        for (int r = 0; r < R; r++) y[(r0 + r) * N + o0 + i] = vsum(acc[i][r]);
}

typedef struct { const float *x; int64_t M, K; const float *w; int64_t o_begin, o_end; float *y; int64_t N; } rows_job_t;

#define ROWS_CASES(W) \
    switch (j->M - r0 < GROUP ? (int)(j->M - r0) : GROUP) { \
    case 1: block(j->x, r0, 1, j->w, j->K, o, W, j->y, j->N); break; \
    case 2: block(j->x, r0, 2, j->w, j->K, o, W, j->y, j->N); break; \
    case 3: block(j->x, r0, 3, j->w, j->K, o, W, j->y, j->N); break; \
    default: block(j->x, r0, GROUP, j->w, j->K, o, W, j->y, j->N); break; \
    }

static void rows_run(const rows_job_t *j) {
    int64_t o = j->o_begin;
    for (; o + WROWS <= j->o_end; o += WROWS)       /* constant trip counts: registers */
        for (int64_t r0 = 0; r0 < j->M; r0 += GROUP) { ROWS_CASES(WROWS) }
    for (; o < j->o_end; o++)
        for (int64_t r0 = 0; r0 < j->M; r0 += GROUP) { ROWS_CASES(1) }
}

static void rows_task(const void *arg) { rows_run((const rows_job_t *)arg); }

/* Returns 0. With threads == 2 and enough work, outputs [split, N) on the helper (pool.h). */
int row_products(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int64_t threads) {
    rows_job_t all = {x, M, K, w, 0, N, y, N};
    if (threads < 2 || N < 64 || M * N * K < 65536) { rows_run(&all); return 0; }
    rows_job_t first = all, second = all;
    first.o_end = second.o_begin = (N / 2) & ~(int64_t)(WROWS - 1);
    pool_run2(rows_task, &first, &second);
    return 0;
}
