/* TurboQuant's coder for decode-sized calls (KV_QUANT_SCHEME=turboquant; cache/turboquant.py has the
   scheme, backends/cpu/turboquant_host.py binds this): n vectors of dim floats ->
   their packed codes, one factor f each, and the vectors the codes decode to -- one call a layer
   for K and V together, where MLX's graph is some fifteen kernels and numpy a dozen calls.

   Per vector x (the n of x0, then the n of x1: K and V): norm |x|; u = (x * signs) @ H per block
   of `block` coordinates (Sylvester Hadamard, as a fast transform); t = u / max(norm, 1e-30) (as a
   product by the reciprocal); code = the number of boundaries below t (counted against each
   boundary up to 4 bits, a branchless binary search over the 255 at 8; the rule of
   Scheme._nearest); c = ints[code]; f = norm / (root * |c|);
   decoded = ((c @ H per block) * f) * signs. Encoding need not be exact (its output is the codes);
   decoding is: c holds integers, so every butterfly sum is an integer below 2^24 -- exact in
   float32 in any order, the same floats as MLX's product -- then the same two float32 products in
   the same order (a product by +-1 is exact). So a stored entry decodes, bit for bit, to what the
   live cache attended. Codes are packed as Scheme._pack does: `group` codes of `bits` bits
   little-endian in `group_bytes` bytes. Part of native/kernels.c. */
#include <math.h>
#include <stdint.h>

#define TQ_MAX_DIM 1024

static void tq_hadamard(float *a, int64_t dim, int64_t block) {
    for (int64_t b0 = 0; b0 < dim; b0 += block)
        for (int64_t h = 1; h < block; h <<= 1)
            for (int64_t i = b0; i < b0 + block; i += h << 1)
                for (int64_t j = i; j < i + h; j++) {
                    float x = a[j], y = a[j + h];
                    a[j] = x + y;
                    a[j + h] = x - y;
                }
}

static void tq_code_one(const float *xv, int64_t dim, int64_t block, const float *signs, const float *bounds,
                        int64_t nbounds, const float *ints, float root, int64_t bits, int64_t group,
                        int64_t group_bytes, uint8_t *pv, float *f, float *ov) {
    float u[TQ_MAX_DIM], c[TQ_MAX_DIM];
    uint8_t code[TQ_MAX_DIM];
    float ss = 0.0f;
    for (int64_t j = 0; j < dim; j++) {
        ss += xv[j] * xv[j];
        u[j] = xv[j] * signs[j];
    }
    float norm = sqrtf(ss);
    tq_hadamard(u, dim, block);
    float r = 1.0f / (norm > 1e-30f ? norm : 1e-30f);
    int32_t k[TQ_MAX_DIM];
    for (int64_t j = 0; j < dim; j++)
        u[j] *= r;
    if (nbounds <= 15) {
        /* up to 4 bits: every boundary against every coordinate, vectorised across coordinates */
        for (int64_t j = 0; j < dim; j++)
            k[j] = 0;
        for (int64_t i = 0; i < nbounds; i++) {
            float b = bounds[i];
            for (int64_t j = 0; j < dim; j++)
                k[j] += u[j] > b;
        }
    } else {
        for (int64_t j = 0; j < dim; j++) {
            int32_t at = 0;
            for (int64_t step = (nbounds + 1) >> 1; step > 0; step >>= 1)
                at += bounds[at + step - 1] < u[j] ? (int32_t)step : 0;
            k[j] = at;
        }
    }
    float cc = 0.0f;
    for (int64_t j = 0; j < dim; j++) {
        code[j] = (uint8_t)k[j];
        c[j] = ints[k[j]];
        cc += c[j] * c[j];
    }
    float fv = norm / (root * sqrtf(cc));
    *f = fv;
    tq_hadamard(c, dim, block);
    for (int64_t j = 0; j < dim; j++)
        ov[j] = (c[j] * fv) * signs[j];
    for (int64_t g = 0; g < dim / group; g++) {
        uint32_t word = 0;
        for (int64_t i = 0; i < group; i++)
            word |= (uint32_t)code[g * group + i] << (bits * i);
        for (int64_t i = 0; i < group_bytes; i++)
            pv[g * group_bytes + i] = (uint8_t)(word >> (8 * i));
    }
}

int tq_code(const float *x0, const float *x1, int64_t n, int64_t dim, int64_t block, const float *signs,
            const float *bounds, int64_t nbounds, const float *ints, float root, int64_t bits, uint8_t *packed,
            float *f, float *out) {
    if (dim <= 0 || dim > TQ_MAX_DIM || block <= 0 || dim % block || nbounds != (1 << bits) - 1)
        return 1;
    int64_t group = bits == 3 ? 8 : 8 / bits, group_bytes = group * bits / 8;
    int64_t row_bytes = dim / group * group_bytes;
    for (int64_t v = 0; v < 2 * n; v++) {
        const float *xv = v < n ? x0 + v * dim : x1 + (v - n) * dim;
        tq_code_one(xv, dim, block, signs, bounds, nbounds, ints, root, bits, group, group_bytes,
                    packed + v * row_bytes, f + v, out + v * dim);
    }
    return 0;
}
