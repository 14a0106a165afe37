/* One AdamW step over a flat run of numbers, in one pass, with the bits of torch's fused CPU AdamW.

   A host optimizer's numbers rest narrow (tiled_adamw.py says which forms): the fp32 master whole
   or as a bf16 weight plus a 16-bit residual (split_master.py), the gradient in fp32 or bf16, the
   moments in fp32 or as 8-bit blockwise codes (moments8.py). This loop reads each number's pieces
   once, rebuilds the fp32 master (and, a block of 256 at a time, the moments), runs AdamW on it and
   writes every piece back where it rests, so each byte crosses memory once each way.

   The arithmetic is torch._fused_adamw_'s for fp32 parameters in ADAMW mode, operation for
   operation, so both paths leave the same bits (tests/unit/test_native_adamw.py holds them to it,
   and the loader checks it again on the machine before using this file):
     p = p * decay                                  only when weight decay is nonzero
     m = fma(coeff, g - m, base)                    lerp(m, g, w), w = 1 - beta1: coeff = w and base = m
                                                    when |w| < 0.5, else coeff = w - 1 and base = g
     v = fma(c2 * g, g, v * beta2)                  c2 = 1 - beta2 (torch's vector path, as gcc
                                                    contracted its v * beta2 + c2 * g * g)
     v = fma(v, beta2, c2 * g * g)                  (its scalar path: the run's last n % 8 numbers)
     p = p - step_size * m / (sqrt(v) / bias2_sqrt + eps)
   Each constant is a double rounded once to float, as torch rounds it. Compiled with
   -ffp-contract=off, so only the fmaf calls written here fuse. The gradient is first multiplied
   by the clipping coefficient in fp32 (g * (float)clip), as tiled_adamw's tile path does.

   8-bit moments are decoded and coded again exactly as moments8.py does it (decode: map[code] *
   absmax; code: absmax = max |x| of the block, x * (1 / max(absmax, 1e-38)) looked up in its
   tables), so they too leave the tile path's bits. Built with AVX-512 VBMI (native/adamw.py asks
   for it where the CPU has it), they take a path without table gathers (Fast, below): byte
   permutes decode, each decade's line of the map codes, and the split layout runs fused a block
   at a time; the same bits, checked against the portable loops when loaded.

   Non-finite values: every finite input gives torch's bits. A NaN master gives a NaN, with the bf16
   pattern 0xFFFF (torch's vector conversion); torch's scalar conversion writes 0x7FC0, so the
   patterns of NaN weights may differ from the tile path's. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256       /* numbers an 8-bit moment's absmax covers (moments8.BLOCK) */
#define SLICE_ALIGN BLOCK /* threads split the run at multiples of this: whole blocks, whole cache lines */
#define MAX_THREADS 64
#define CHUNK 4096        /* numbers a pass of the fp32 loop: its gradient is still in cache to empty */

/* AdamW's constants for one step, each a double rounded once to float as torch rounds it
   (native/adamw.py computes them). */
typedef struct {
    float decay;           /* 1 - lr * weight_decay, or 1 without weight decay */
    float lerp_weight;     /* 1 - beta1 */
    float beta2;
    float one_minus_beta2;
    float bias2_sqrt;      /* sqrt(1 - beta2^step) */
    float eps;
    float step_size;       /* lr / (1 - beta1^step) */
    float clip;            /* the clipping coefficient, or 1 when not clipping */
} Hyper;

/* The tables of the AVX-512 VBMI path for one map (native/adamw.py builds them from moments8's).
   Decoding looks each of a code's four bytes up in registers, 64 codes an instruction. Coding counts
   the midpoints below a number |x| on the map's positive side: the map is linear within each decade
   (moments8.dynamic_map), so within a segment (one decade's run of midpoints, or the runs below and
   above all of them) the count is floor(a * slope + intercept). The tables are by binade and hold
   the line of the segment the binade starts in; no binade holds two segment boundaries (checked
   when building), so a number above its binade's boundary takes the next binade's line, which is
   the next segment's. Where that arithmetic lands within UNSURE / 65536 of a step, the midpoints
   themselves decide: the intercepts hold UNSURE / 65536 more, so the lanes to settle are those whose count
   has a fraction below 2 UNSURE / 65536 (where the line fell short of a step by less than UNSURE / 65536,
   the count is one too many: settled too). */
typedef struct {
    uint8_t planes[4][256];  /* byte k of map[c] (little-endian) at planes[k][c] */
    float midpoints[256];    /* the positive side's midpoints in order (`count` of them) */
    uint32_t threshold[32];  /* by binade (exponent mod 32): the bits of the segment boundary in it, or of 2 */
    float slope[32];         /* by binade: 65536 x (the count below a) ~ a * slope + intercept */
    float intercept[32];
    int32_t top[32];         /* by binade: its first segment's last code, 65536 x (it + 1) - 1 */
    int32_t count;           /* midpoints on the positive side: 128 (signed map), 255 (unsigned) */
    int32_t zero;            /* the code of 0.0: 127 (signed), 0 (unsigned) */
} Fast;

/* An 8-bit moment (moments8.Moment8) and its lookup tables (moments8's, by signedness). */
typedef struct {
    uint8_t *codes;        /* a code a number */
    float *absmax;         /* a scale a block of BLOCK numbers */
    const float *map;      /* the 256 values codes stand for (times the absmax) */
    const uint32_t *lookup; /* by bucket (a number's top 16 bits): moments8's base code (bits 0-7), the
                               low 16 bits of the bucket's midpoint (8-23), whether it has one (24) */
    const Fast *fast;      /* the VBMI path's tables, or NULL: the portable loops */
} Coded;

typedef struct {
    int64_t numel;
    int64_t vector_end;   /* numbers before it take torch's vector formula for v, the rest its scalar one */
    int32_t split;        /* 1: weight + residual; 0: whole fp32 master */
    int32_t grad_bf16;    /* 1: bf16 gradient; 0: fp32 */
    int32_t empty_grad;   /* 1: zero the gradient once read (an accumulator the step consumes) */
    int32_t threads;
    float *master;        /* whole master, or NULL */
    uint16_t *weight;     /* split: bf16 weight */
    int16_t *residual;    /* split: residual */
    uint16_t *shadow;     /* a bf16 copy of the new weights (whole: its shadow; split: a copy), or NULL */
    void *grad;
    float *exp_avg;       /* fp32 moments, or NULL when coded */
    float *exp_avg_sq;
    int32_t coded;        /* 1: 8-bit moments, in the two below */
    Coded exp_avg_coded;
    Coded exp_avg_sq_coded;
} Run;

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bf16 -> fp32: exact. */
static inline float widen(uint16_t b) { return from_bits((uint32_t)b << 16); }

/* fp32 -> bf16, round to nearest even (a carry into the exponent rounds up to the next binade or
   to infinity, as it should); NaN -> 0xFFFF. */
static inline uint16_t narrow(float f) {
    uint32_t u = to_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : 0u;  /* integer compares: no branch */
    return (uint16_t)(rounded | nan);
}

/* split_master.combine: (bits(weight) << 16) + residual, the residual sign-extended. */
static inline float combine(uint16_t weight, int16_t residual) {
    return from_bits(((uint32_t)weight << 16) + (uint32_t)(int32_t)residual);
}

/* split_master.split's residual: bits(master) - int16(weight) * 65536 in wrapping int32, clamped. */
static inline int16_t residual_of(float master, uint16_t weight) {
    uint32_t top = (uint32_t)(int32_t)(int16_t)weight << 16;
    int32_t diff = (int32_t)(to_bits(master) - top);
    diff = diff < 32767 ? diff : 32767;
    diff = diff > -32768 ? diff : -32768;
    return (int16_t)diff;
}

/* One number's AdamW. `scalar`: torch's scalar-path formula for v (a compile-time constant). The
   clip and decay factors are 1 when unused: x * 1.0f is x, so no branch is needed to skip them. */
static inline __attribute__((always_inline)) float adamw(float p, float g, float *m, float *v,
                                                         const Hyper h, const float coeff,
                                                         const int small, const int scalar) {
    const float c2 = h.one_minus_beta2;
    g = g * h.clip;
    p = p * h.decay;
    const float m0 = *m, v0 = *v;  /* loaded whatever the branch: a conditional load stops vectorizing */
    const float m1 = fmaf(coeff, g - m0, small ? m0 : g);
    const float v1 = scalar ? fmaf(v0, h.beta2, c2 * g * g) : fmaf(c2 * g, g, v0 * h.beta2);
    *m = m1;
    *v = v1;
    return p - h.step_size * m1 / (sqrtf(v1) / h.bias2_sqrt + h.eps);
}

/* `count` numbers from pointers already at the first one. split, grad_bf16, shadows and scalar are
   compile-time constants at each call, so every loop is straight-line code that gcc vectorizes; the
   pointers are restrict parameters (the run's tensors never overlap), so it needs no run-time
   overlap checks. */
static inline __attribute__((always_inline)) void span(
        int64_t count, const Hyper h, float *restrict master, uint16_t *restrict weight,
        int16_t *restrict residual, uint16_t *restrict shadow, uint16_t *restrict g16, float *restrict g32,
        float *restrict m, float *restrict v, const int split, const int grad_bf16, const int shadows,
        const int scalar) {
    const int small = fabsf(h.lerp_weight) < 0.5f;  /* lerp's two branches, as torch picks them */
    const float coeff = small ? h.lerp_weight : h.lerp_weight - 1.0f;
    for (int64_t i = 0; i < count; i++) {
        float p = split ? combine(weight[i], residual[i]) : master[i];
        float g = grad_bf16 ? widen(g16[i]) : g32[i];
        p = adamw(p, g, &m[i], &v[i], h, coeff, small, scalar);
        uint16_t top = narrow(p);
        if (split) {
            weight[i] = top;
            residual[i] = residual_of(p, top);
        } else {
            master[i] = p;
        }
        if (shadows) shadow[i] = top;
    }
}

/* ---------------------------------------------------------------- the split layout on AVX2 */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_SPLIT_AVX2 1

/* span()'s split layout, on torch's vector formula, 8 numbers an instruction, written
   out because gcc's own vectorization of span() ran at a third of the divider's rate on AVX2 (Zen 3: 1.40
   ns a number in the L3 against 0.47 for the square root and two divisions alone). The same operations
   on the same numbers in the same order, so the same bits: bf16 pieces widened by zero-extension and
   shifts, narrow() and residual_of() as integer operations, the residual's clamp as the signed
   saturation of a 32-to-16-bit pack. The gradient is bf16 (one micro-batch a step) or fp32 (an
   accumulator: train.grad_accum > 1), `grad_bf16`. `clips` and `decays` are compile-time constants
   (x * 1.0f is x, so skipping the multiply changes no bit). Returns the numbers done: `count` rounded
   down to 16. */
static inline __attribute__((always_inline)) int64_t split_avx2_of(
        int64_t count, const Hyper *h, uint16_t *restrict weight, int16_t *restrict residual,
        uint16_t *restrict shadow, const void *restrict grad, float *restrict m, float *restrict v,
        const int grad_bf16, const int clips, const int decays, const int small) {
    const float coeff_value = small ? h->lerp_weight : h->lerp_weight - 1.0f;
    const __m256 clip = _mm256_set1_ps(h->clip), decay = _mm256_set1_ps(h->decay);
    const __m256 coeff = _mm256_set1_ps(coeff_value), beta2 = _mm256_set1_ps(h->beta2);
    const __m256 c2 = _mm256_set1_ps(h->one_minus_beta2), bias2_sqrt = _mm256_set1_ps(h->bias2_sqrt);
    const __m256 eps = _mm256_set1_ps(h->eps), step_size = _mm256_set1_ps(h->step_size);
    const __m256i round_bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), infinity = _mm256_set1_epi32(0x7F800000);
    const int64_t done = count & ~(int64_t)15;
    for (int64_t i = 0; i < done; i += 16) {
        __m256i tops[2], residuals[2];
        for (int half = 0; half < 2; half++) {
            const int64_t at = i + 8 * half;
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(weight + at)));
            const __m256i low = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(residual + at)));
            __m256 p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(w, 16), low));
            __m256 g = grad_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                       _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + at))), 16))
                                 : _mm256_loadu_ps((const float *)grad + at);
            if (clips) g = _mm256_mul_ps(g, clip);
            if (decays) p = _mm256_mul_ps(p, decay);
            const __m256 m0 = _mm256_loadu_ps(m + at), v0 = _mm256_loadu_ps(v + at);
            const __m256 m1 = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m0), small ? m0 : g);
            const __m256 v1 = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v0, beta2));
            _mm256_storeu_ps(m + at, m1);
            _mm256_storeu_ps(v + at, v1);
            const __m256 denominator = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bias2_sqrt), eps);
            const __m256i u = _mm256_castps_si256(_mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m1),
                                                                                 denominator)));
            /* narrow(): (u + 0x7FFF + ((u >> 16) & 1)) >> 16, 0xFFFF for a NaN */
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
            const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, round_bias), lsb), 16);
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, magnitude), infinity);
            tops[half] = _mm256_or_si256(rounded, _mm256_srli_epi32(nan, 16));
            residuals[half] = _mm256_sub_epi32(u, _mm256_slli_epi32(tops[half], 16));  /* residual_of, unclamped */
        }
        /* packs interleave the 128-bit lanes: [a0-3 b0-3 a4-7 b4-7], put in order by one qword permute */
        const __m256i tops16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(tops[0], tops[1]), 0xD8);
        const __m256i residuals16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(residuals[0], residuals[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(weight + i), tops16);
        _mm256_storeu_si256((__m256i *)(residual + i), residuals16);
        if (shadow) _mm256_storeu_si256((__m256i *)(shadow + i), tops16);
    }
    return done;
}

/* split_avx2_of with its compile-time choices made from the run and the step's constants: one loop each. */
static int64_t split_avx2(const Run *r, const Hyper *h, int64_t at, int64_t count, float *m, float *v) {
    const int small = fabsf(h->lerp_weight) < 0.5f, clips = h->clip != 1.0f, decays = h->decay != 1.0f;
    const int kind = r->grad_bf16 * 8 + small * 4 + clips * 2 + decays;
    uint16_t *const weight = r->weight + at, *const shadow = r->shadow ? r->shadow + at : NULL;
    const void *const grad = r->grad_bf16 ? (const void *)((const uint16_t *)r->grad + at)
                                          : (const void *)((const float *)r->grad + at);
    int16_t *const residual = r->residual + at;
#define SPLIT_AVX2(k) case k: return split_avx2_of(count, h, weight, residual, shadow, grad, m, v, (k) >> 3 & 1, \
                                                   (k) >> 1 & 1, (k) & 1, (k) >> 2 & 1)
    switch (kind) {
        SPLIT_AVX2(0); SPLIT_AVX2(1); SPLIT_AVX2(2); SPLIT_AVX2(3); SPLIT_AVX2(4); SPLIT_AVX2(5); SPLIT_AVX2(6);
        SPLIT_AVX2(7); SPLIT_AVX2(8); SPLIT_AVX2(9); SPLIT_AVX2(10); SPLIT_AVX2(11); SPLIT_AVX2(12);
        SPLIT_AVX2(13); SPLIT_AVX2(14); default: SPLIT_AVX2(15);
    }
#undef SPLIT_AVX2
}
#else
#define HAVE_SPLIT_AVX2 0
static int64_t split_avx2(const Run *r, const Hyper *h, int64_t at, int64_t count, float *m, float *v) {
    (void)r, (void)h, (void)at, (void)count, (void)m, (void)v;
    return 0;
}
#endif

#define AT(pointer) ((pointer) ? (pointer) + at : NULL)
#define SPAN(split, bf16, shadows)                                                                    \
    span(count, *h, AT(r->master), AT(r->weight), AT(r->residual), AT(r->shadow), AT((uint16_t *)r->grad), \
         AT((float *)r->grad), m, v, split, bf16, shadows, scalar)

/* Numbers [at, at + count) of the run on torch's vector formula, with their moments in m and v
   (fp32, at their first): one vectorized loop per layout. */
static inline __attribute__((always_inline)) void vector_span(const Run *r, const Hyper *h, int64_t at,
                                                              int64_t count, float *m, float *v) {
    if (count <= 0) return;
    if (HAVE_SPLIT_AVX2 && r->split) {
        const int64_t done = split_avx2(r, h, at, count, m, v);
        at += done, count -= done, m += done, v += done;
        if (count == 0) return;
    }
    const int kind = r->split * 4 + r->grad_bf16 * 2 + (r->shadow != NULL), scalar = 0;
    switch (kind) {
        case 0: SPAN(0, 0, 0); break;
        case 1: SPAN(0, 0, 1); break;
        case 2: SPAN(0, 1, 0); break;
        case 3: SPAN(0, 1, 1); break;
        case 4: SPAN(1, 0, 0); break;
        case 5: SPAN(1, 0, 1); break;
        case 6: SPAN(1, 1, 0); break;
        default: SPAN(1, 1, 1); break;
    }
}

/* The same on torch's scalar formula: the run's last SCALAR_TAIL - 1 numbers at most, so one plain
   loop for every layout (which keeps the library small and quick to build). */
static __attribute__((noinline)) void scalar_span(const Run *r, const Hyper *h, int64_t at, int64_t count,
                                                  float *m, float *v) {
    span(count, *h, AT(r->master), AT(r->weight), AT(r->residual), AT(r->shadow), AT((uint16_t *)r->grad),
         AT((float *)r->grad), m, v, r->split, r->grad_bf16, r->shadow != NULL, 1);
}

/* [begin, end) with moments m and v for those numbers: before r->vector_end on the vector
   formula, from it on the scalar one. */
static inline __attribute__((always_inline)) void both_paths(const Run *r, const Hyper *h, int64_t begin,
                                                             int64_t end, float *m, float *v) {
    int64_t mid = r->vector_end < begin ? begin : r->vector_end > end ? end : r->vector_end;
    vector_span(r, h, begin, mid - begin, m, v);
    if (end > mid) scalar_span(r, h, mid, end - mid, m + (mid - begin), v + (mid - begin));
}

/* moments8.py's dequantization: code map[c] times the block's absmax. */
static void decode(const Coded *c, int64_t begin, int64_t count, float *restrict out) {
    const float absmax = c->absmax[begin / BLOCK];
    const uint8_t *restrict codes = c->codes + begin;
    for (int64_t j = 0; j < count; j++) out[j] = c->map[codes[j]] * absmax;  /* a table load a number */
}

/* Each x times `inverse` takes the code of its 16-bit bucket, plus one above the bucket's midpoint
   (moments8's rule). A midpoint lies inside its bucket, so it shares the number's sign and top bits,
   and "above" is a compare of the low 16 bits: greater for a positive number, smaller for a negative
   one; so one table of int32 entries serves, one load a number. (gcc 12's AVX2 build makes both
   loops' loads scalar ones inserted into vectors; vpgatherdd in their place, and a coding without
   tables, each ran slower on Zen 3: benchmarks/docs/host_adam_bandwidth.md.) */
static void code_block(uint8_t *restrict codes, const float *restrict x, int64_t count, float inverse,
                       const uint32_t *restrict lookup) {
    for (int64_t j = 0; j < count; j++) {
        const uint32_t bits = to_bits(x[j] * inverse);
        const uint32_t entry = lookup[bits >> 16], low = bits & 0xFFFFu, mid = (entry >> 8) & 0xFFFFu;
        const uint32_t beyond = (bits >> 31) ? low < mid : low > mid;
        codes[j] = (uint8_t)((entry & 0xFFu) + (beyond & (entry >> 24)));
    }
}

/* moments8.py's quantization of one block: absmax = the largest |x| (a NaN if any is NaN, as torch's
   amax gives: on |x|'s bit patterns NaN orders above every number), then the codes of x times
   1 / max(absmax, 1e-38). */
static void encode(const Coded *c, int64_t begin, int64_t count, const float *x) {
    uint32_t largest = 0;
    for (int64_t j = 0; j < count; j++) {
        uint32_t bits = to_bits(x[j]) & 0x7FFFFFFFu;
        largest = bits > largest ? bits : largest;
    }
    const float absmax = from_bits(largest);
    c->absmax[begin / BLOCK] = absmax;
    code_block(c->codes + begin, x, count, 1.0f / (absmax < 1e-38f ? 1e-38f : absmax), c->lookup);
}

/* ---------------------------------------------------------------- 8-bit moments on AVX-512 VBMI */

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_FAST 1

#define FIXED 16             /* counts are found in 1/65536ths */
#define UNSURE 8             /* within 8/65536 of a step, the midpoints decide */
#define FLOOR_BITS 0x33800000 /* 2^-24 (binade 103): below either map's smallest midpoint */

/* A map's planes in registers: four 64-byte quarters of each byte plane. */
typedef struct { __m512i quarter[4][4]; } Planes;

/* A map's segment tables in registers. */
typedef struct {
    __m512i threshold_lo, threshold_hi, top_lo, top_hi;
    __m512 slope_lo, slope_hi, intercept_lo, intercept_hi;
} Segments;

static inline Planes planes_of(const Fast *f) {
    Planes p;
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 4; q++) p.quarter[k][q] = _mm512_loadu_si512(f->planes[k] + 64 * q);
    return p;
}

static inline Segments segments_of(const Fast *f) {
    return (Segments){_mm512_loadu_si512(f->threshold), _mm512_loadu_si512(f->threshold + 16),
                      _mm512_loadu_si512(f->top), _mm512_loadu_si512(f->top + 16),
                      _mm512_loadu_ps(f->slope), _mm512_loadu_ps(f->slope + 16),
                      _mm512_loadu_ps(f->intercept), _mm512_loadu_ps(f->intercept + 16)};
}

/* The order 64 codes are put in before decoding, so that the two rounds of unpacking (which
   interleave within 16-byte lanes) leave the four 16-number results in order: the byte at
   16 L + 4 j + e of the permuted codes is code 16 j + 4 L + e. */
static inline __m512i unpack_order(void) {
    uint8_t order[64];
    for (int lane = 0; lane < 4; lane++)
        for (int j = 0; j < 4; j++)
            for (int e = 0; e < 4; e++) order[16 * lane + 4 * j + e] = (uint8_t)(16 * j + 4 * lane + e);
    return _mm512_loadu_si512(order);
}

/* map[c] * absmax for 64 codes into out: each byte of map[c] is a 256-entry byte lookup (two
   128-entry permutes, picked by the code's top bit), and the four bytes are interleaved into fp32. */
static inline void decode64(const Planes *p, __m512i order, const uint8_t *codes, __m512 absmax, float *out) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
    const __mmask64 high = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; k++)
        b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(p->quarter[k][0], c, p->quarter[k][1]),
                                      _mm512_permutex2var_epi8(p->quarter[k][2], c, p->quarter[k][3]));
    const __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23)), absmax));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23)), absmax));
    _mm512_storeu_ps(out + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23)), absmax));
    _mm512_storeu_ps(out + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23)), absmax));
}

/* A block's numbers decoded into out (BLOCK of them). */
static void fast_decode(const Coded *c, int64_t begin, float *restrict out) {
    const Planes p = planes_of(c->fast);
    const __m512i order = unpack_order();
    const __m512 absmax = _mm512_set1_ps(c->absmax[begin / BLOCK]);
    for (int j = 0; j < BLOCK; j += 64) decode64(&p, order, c->codes + begin + j, absmax, out + j);
}

/* fixed clamped to the top of the segment `binade` names. */
static inline __m512i line_fixed_top(const Segments *s, __m512i binade, __m512i fixed) {
    return _mm512_min_epi32(fixed, _mm512_permutex2var_epi32(s->top_lo, binade, s->top_hi));
}

/* Per lane, the code of 0.0 plus the count of the positive side's midpoints below a (fp32 bits; a
   negative int32 counts none), found by the segment's line; lanes where the line lands near a step are
   added to *unsure. */
static inline __m512i line_counts(const Segments *s, __m512i a, __mmask16 *unsure) {
    a = _mm512_max_epi32(a, _mm512_set1_epi32(FLOOR_BITS));
    __m512i binade = _mm512_srli_epi32(a, 23);  /* 103 .. 127: each its own entry mod 32 */
    const __mmask16 above = _mm512_cmpgt_epi32_mask(a, _mm512_permutex2var_epi32(s->threshold_lo, binade,
                                                                                  s->threshold_hi));
    binade = _mm512_mask_add_epi32(binade, above, binade, _mm512_set1_epi32(1));  /* the next segment's line */
    const __m512 slope = _mm512_permutex2var_ps(s->slope_lo, binade, s->slope_hi);
    const __m512 line = _mm512_fmadd_ps(_mm512_castsi512_ps(a), slope,
                                        _mm512_permutex2var_ps(s->intercept_lo, binade, s->intercept_hi));
    const __m512i fixed = _mm512_cvt_roundps_epi32(line, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *unsure |= _mm512_testn_epi32_mask(fixed, _mm512_set1_epi32((1 << FIXED) - 2 * UNSURE));
    return _mm512_srai_epi32(line_fixed_top(s, binade, fixed), FIXED);
}

/* The lanes in `unsure` counted exactly: from the line's count (a step off at most) to the one
   whose neighbouring midpoints enclose a. */
static __attribute__((noinline)) __m512i settle(const Fast *f, __m512i a, __m512i counts, __mmask16 unsure) {
    int32_t bits[16], n[16];
    _mm512_storeu_si512(bits, _mm512_max_epi32(a, _mm512_set1_epi32(FLOOR_BITS)));
    _mm512_storeu_si512(n, counts);
    for (int lane = 0; lane < 16; lane++) {
        if (!((unsure >> lane) & 1)) continue;
        const float x = from_bits((uint32_t)bits[lane]);
        int32_t k = n[lane] - f->zero;  /* (the tables' counts start at the code of 0.0) */
        while (k > 0 && x <= f->midpoints[k - 1]) k--;
        while (k < f->count && x > f->midpoints[k]) k++;
        n[lane] = k + f->zero;
    }
    return _mm512_loadu_si512(n);
}

/* 16 codes of x * inverse on the signed map (moments8's rule: the code is the number of the
   map's midpoints below the number). Its negative side mirrors the positive one (the map is
   symmetric but for the code of 1.0), so -t takes zero - (the positive side's midpoints at or below
   t): those below the next float above t; below the map's end (-t < -1), code 0. */
static inline __m512i code16_signed(const Fast *f, const Segments *s, __m512 x, __m512 inverse) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, inverse));
    const __mmask16 negative = _mm512_movepi32_mask(bits);
    const __m512i a = _mm512_mask_sub_epi32(bits, negative, bits, _mm512_set1_epi32(0x7FFFFFFF));  /* |x| + 1 ulp */
    __mmask16 unsure = 0;
    __m512i n = line_counts(s, a, &unsure);
    if (unsure) n = settle(f, a, n, unsure);
    const __m512i code = _mm512_mask_sub_epi32(n, negative, _mm512_set1_epi32(2 * f->zero), n);  /* n: zero + count */
    return _mm512_max_epi32(code, _mm512_setzero_si512());
}

/* The same on the unsigned map: every midpoint is positive, so a negative number (a negative
   int32 here, which line_counts counts as below them all) takes code 0. */
static inline __m512i code16_unsigned(const Fast *f, const Segments *s, __m512 x, __m512 inverse) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, inverse));
    __mmask16 unsure = 0;
    __m512i n = line_counts(s, bits, &unsure);
    if (unsure) n = settle(f, bits, n, unsure);
    return n;
}

static inline __m512i code16(const Fast *f, const Segments *s, __m512 x, __m512 inverse) {
    return f->zero ? code16_signed(f, s, x, inverse) : code16_unsigned(f, s, x, inverse);
}

/* encode()'s absmax of a block from the running maximum of its |x| bit patterns, stored; returns
   the factor the block's numbers are scaled by, or 0 where the absmax is not finite (an inf or a
   NaN in the block: every number of it scales to NaN or 0, outside the lines' range, and
   code_block codes it). */
static inline float scale_of(const Coded *c, int64_t begin, __m512i largest) {
    const float absmax = from_bits(_mm512_reduce_max_epu32(largest));
    c->absmax[begin / BLOCK] = absmax;
    return absmax <= 3.4028234663852886e38f ? 1.0f / (absmax < 1e-38f ? 1e-38f : absmax) : 0.0f;
}

/* A block's codes from its numbers x and their |x| maximum. */
static inline void code_block_fast(const Coded *c, const Segments *s, int64_t begin, const float *restrict x,
                                   __m512i largest) {
    const float inverse = scale_of(c, begin, largest);
    if (inverse == 0.0f) {
        code_block(c->codes + begin, x, BLOCK, 1.0f / c->absmax[begin / BLOCK], c->lookup);  /* inf: 0; NaN: NaN */
        return;
    }
    const __m512 scale = _mm512_set1_ps(inverse);
    for (int j = 0; j < BLOCK; j += 16)
        _mm_storeu_si128((__m128i *)(c->codes + begin + j),
                         _mm512_cvtepi32_epi8(code16(c->fast, s, _mm512_loadu_ps(x + j), scale)));
}

static inline __m512i abs_max(__m512i largest, __m512 x) {
    return _mm512_max_epu32(largest, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
}

/* A whole block coded as encode() does it. */
static void fast_encode(const Coded *c, int64_t begin, const float *restrict x) {
    __m512i largest = _mm512_setzero_si512();
    for (int j = 0; j < BLOCK; j += 16) largest = abs_max(largest, _mm512_loadu_ps(x + j));
    const Segments s = segments_of(c->fast);
    code_block_fast(c, &s, begin, x, largest);
}
/* map[c] * absmax for 64 codes into four registers (decode64's lookups on the map's planes in memory). */
static inline void decode64_into(const Fast *f, __m512i order, const uint8_t *codes, __m512 absmax, __m512 out[4]) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
    const __mmask64 high = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; k++) {
        const uint8_t *plane = f->planes[k];
        b[k] = _mm512_mask_blend_epi8(
            high, _mm512_permutex2var_epi8(_mm512_loadu_si512(plane), c, _mm512_loadu_si512(plane + 64)),
            _mm512_permutex2var_epi8(_mm512_loadu_si512(plane + 128), c, _mm512_loadu_si512(plane + 192)));
    }
    const __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23)), absmax);
    out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23)), absmax);
    out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23)), absmax);
    out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23)), absmax);
}

/* What a fused loop does, fixed when it is compiled: lerp's branch (|1 - beta1| < 0.5), the clipping
   multiply (skipped where the coefficient is 1) and the weight decay's (skipped where it is 1). */
#define SMALL 1
#define CLIPS 2
#define DECAYS 4

/* The step's constants, one a register. */
typedef struct { __m512 decay, coeff, beta2, one_minus_beta2, bias2_sqrt, eps, step_size, clip; } Constants;

/* The fused loop holds 32 numbers as two registers in the order the 16-bit unpacks leave them: the
   first takes numbers 0-3, 8-11, 16-19, 24-27 (the low half of each 16-byte lane), the second the
   rest; packing two such registers back to 16 bits restores the order. The moments are decoded
   straight into that order (decode64_into with interleaved_order()), and their codes are put back
   in order by one permute when packed (code_order()). */
static inline int interleaved(int k, int lane, int e) {  /* number at lane `lane`, place e of register k of 64 */
    return 32 * (k >> 1) + 8 * lane + 4 * (k & 1) + e;
}

/* decode64_into's code order for the interleaved registers (unpack_order's rule with interleaved()). */
static inline __m512i interleaved_order(void) {
    uint8_t order[64];
    for (int lane = 0; lane < 4; lane++)
        for (int k = 0; k < 4; k++)
            for (int e = 0; e < 4; e++) order[16 * lane + 4 * k + e] = (uint8_t)interleaved(k, lane, e);
    return _mm512_loadu_si512(order);
}

/* Byte j of 32 numbers' codes in order, from two interleaved registers of int32 codes (their low
   bytes): the index vpermt2b takes, for each half of 64. */
static inline __m512i code_order(void) {
    uint8_t order[64];
    for (int j = 0; j < 64; j++) {
        const int r = j % 32, lane = r / 8, e = r % 8;
        order[j] = (uint8_t)(64 * (e >= 4) + 4 * (4 * lane + e % 4));
    }
    return _mm512_loadu_si512(order);
}

/* The high (`part` 1) or low (0) 16 bits of 32 numbers' int32s, in order, from two interleaved registers
   (vpermt2w's index). */
static inline __m512i word_order(const int part) {
    uint16_t order[32];
    for (int j = 0; j < 32; j++) {
        const int lane = j / 8, e = j % 8;
        order[j] = (uint16_t)(32 * (e >= 4) + 2 * (4 * lane + e % 4) + part);
    }
    return _mm512_loadu_si512(order);
}

/* 32 numbers in order from the 16-bit results of two interleaved registers packed by vcvtne2ps2bf16
   (the first register's 16 numbers in words 0-15, the second's in 16-31): vpermw's index. */
static inline __m512i packed_order(void) {
    uint16_t order[32];
    for (int j = 0; j < 32; j++) {
        const int lane = j / 8, e = j % 8;
        order[j] = (uint16_t)(16 * (e >= 4) + 4 * lane + e % 4);
    }
    return _mm512_loadu_si512(order);
}

/* The word permutes store_masters32 puts its results in order with. */
typedef struct { __m512i high_words, low_words, packed; } Orders;

/* narrow()'s bf16 weight of 16 masters, as its bits shifted up 16 (0xFFFF for a NaN). */
static inline __m512i top_half(__m512i u) {
    const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));  /* ties round to even */
    __m512i rounded = _mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF));
    rounded = _mm512_mask_add_epi32(rounded, odd, rounded, _mm512_set1_epi32(1));
    const __mmask16 nan = _mm512_fpclass_ps_mask(_mm512_castsi512_ps(u), 0x81);  /* quiet or signalling */
    return _mm512_mask_mov_epi32(_mm512_and_si512(rounded, _mm512_set1_epi32((int)0xFFFF0000u)), nan,
                                 _mm512_set1_epi32((int)0xFFFF0000u));
}

/* narrow() and residual_of() on 32 new masters u (two interleaved registers) with integer operations:
   the bf16 weights and the residuals, in order. */
static inline __attribute__((always_inline)) void narrow32(const Orders *o, const __m512i u[2], __m512i *weights,
                                                           __m512i *residuals) {
    __m512i top[2];
    for (int h = 0; h < 2; h++) top[h] = top_half(u[h]);
    *weights = _mm512_permutex2var_epi16(top[0], o->high_words, top[1]);
    *residuals = _mm512_packs_epi32(_mm512_sub_epi32(u[0], top[0]), _mm512_sub_epi32(u[1], top[1]));  /* clamped */
}

#if defined(__AVX512BF16__)
/* The same with vcvtne2ps2bf16, which rounds to nearest even as narrow() does; the residual is then
   the master's low 16 bits (the weight's own are zero), save for the tie that rounds down to an even
   weight (residual +32768, clamped to 32767). Where the instruction differs from narrow() (it flushes
   subnormals to zero, and keeps a NaN's payload) or that tie occurs, the integer operations decide. */
static inline __attribute__((always_inline)) void narrow32_bf16(const Orders *o, const __m512i u[2],
                                                                __m512i *weights, __m512i *residuals) {
    const __m512 p0 = _mm512_castsi512_ps(u[0]), p1 = _mm512_castsi512_ps(u[1]);
    *weights = _mm512_permutexvar_epi16(o->packed, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    *residuals = _mm512_permutex2var_epi16(u[0], o->low_words, u[1]);
    /* a weight with exponent 0 or 255: a subnormal master (flushed to 0), a NaN, and the zeros and infinities
       that are right either way; adding 1 to the exponent clears bits 8-14 exactly for those two */
    const __mmask32 odd = _mm512_testn_epi16_mask(_mm512_add_epi16(*weights, _mm512_set1_epi16(0x0080)),
                                                  _mm512_set1_epi16(0x7F00));
    if (odd | _mm512_cmpeq_epi16_mask(*residuals, _mm512_set1_epi16((short)0x8000))) narrow32(o, u, weights, residuals);
}
#define NARROW32 narrow32_bf16
#else
#define NARROW32 narrow32
#endif

/* 64 codes (interleaved registers of int32 codes c) stored in order. */
static inline void store_codes64(uint8_t *codes, __m512i order, const __m512i c[4]) {
    const __m512i low = _mm512_permutex2var_epi8(c[0], order, c[1]), high = _mm512_permutex2var_epi8(c[2], order, c[3]);
    _mm512_storeu_si512(codes, _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, low, high));
}

/* A block's codes from its new numbers x (interleaved), one vector at a time with code16 (lanes near a
   step settled as they come), put in order. */
static __attribute__((noinline)) void code_settled(const Coded *c, const Segments *s, __m512i order, int64_t begin,
                                                   const float *restrict x, __m512 scale, const int is_signed) {
    for (int j = 0; j < BLOCK; j += 64) {
        __m512i codes[4];
        for (int q = 0; q < 4; q++)
            codes[q] = is_signed ? code16_signed(c->fast, s, _mm512_loadu_ps(x + j + 16 * q), scale)
                                 : code16_unsigned(c->fast, s, _mm512_loadu_ps(x + j + 16 * q), scale);
        store_codes64(c->codes + begin + j, order, codes);
    }
}

/* fixed16's first stage: the scaled number's |bits| (floored) and the segment whose line counts it. */
typedef struct { __m512i floored, segment; __mmask16 negative; } Scaled;

static inline Scaled segment16(const Segments *s, __m512 x, __m512 scale, const int is_signed) {
    Scaled t;
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, scale));
    t.negative = is_signed ? _mm512_movepi32_mask(bits) : 0;
    const __m512i a = is_signed ? _mm512_mask_sub_epi32(bits, t.negative, bits, _mm512_set1_epi32(0x7FFFFFFF)) : bits;
    t.floored = _mm512_max_epi32(a, _mm512_set1_epi32(FLOOR_BITS));
    const __m512i binade = _mm512_srli_epi32(t.floored, 23);
    const __mmask16 above = _mm512_cmpgt_epi32_mask(t.floored, _mm512_permutex2var_epi32(s->threshold_lo, binade,
                                                                                          s->threshold_hi));
    t.segment = _mm512_mask_add_epi32(binade, above, binade, _mm512_set1_epi32(1));  /* the next segment's line */
    return t;
}

/* A block's lanes near a step, tracked in one instruction a vector: the least fraction (a count's low 16
   bits) seen in each lane, by an unsigned 16-bit min that also mins the counts' upper halves, which
   any_near() ignores. Start from all ones. */
static inline __m512i near_min(__m512i near, __m512i fixed) { return _mm512_min_epu16(near, fixed); }

/* Whether some lane's least fraction was below 2 UNSURE / 65536 (its bits 4-15 all zero). */
static inline int any_near(__m512i near) {
    return _mm512_testn_epi32_mask(near, _mm512_set1_epi32((1 << FIXED) - 2 * UNSURE)) != 0;
}

/* fixed16's second stage: the count on the segment's line. */
static inline __m512i line16(const Segments *s, const Scaled t, __m512i mirror, __m512i *near, const int is_signed) {
    const __m512 slope = _mm512_permutex2var_ps(s->slope_lo, t.segment, s->slope_hi);
    const __m512 line = _mm512_fmadd_ps(_mm512_castsi512_ps(t.floored), slope,
                                        _mm512_permutex2var_ps(s->intercept_lo, t.segment, s->intercept_hi));
    const __m512i fixed = line_fixed_top(s, t.segment, _mm512_cvt_roundps_epi32(line, _MM_FROUND_TO_NEAREST_INT |
                                                                                       _MM_FROUND_NO_EXC));
    *near = near_min(*near, fixed);
    if (!is_signed) return fixed;
    /* -t: 2 zero - (zero + the count at t's next float), in bits 16-23 as well (below 0: code 0); `mirror`
       is 2 zero in bits 16-23 over a fraction of all ones */
    const __m512i mirrored = _mm512_mask_sub_epi32(fixed, t.negative, mirror, fixed);
    return _mm512_max_epi32(mirrored, _mm512_setzero_si512());
}

/* 16 numbers' codes as fixed-point counts (the code in bits 16-23, the fraction below; the unsigned
   map's negative numbers 0), without settling: the lanes near a step lower *near's fractions (near_min). */
static inline __m512i fixed16(const Segments *s, __m512 x, __m512 scale, __m512i mirror, __m512i *near,
                               const int is_signed) {
    return line16(s, segment16(s, x, scale, is_signed), mirror, near, is_signed);
}

/* A block's codes from its new numbers x (interleaved) and their |x| maximum: every lane by its line,
   then, where any lane of the block landed near a step (a few blocks in a hundred), the block again
   with code_settled. `order` puts low bytes in order, `order2` bits 16-23. */
static inline void code_interleaved(const Coded *c, const Segments *s, __m512i order, __m512i order2, int64_t begin,
                                    const float *restrict x, __m512i largest, const int is_signed) {
    const float inverse = scale_of(c, begin, largest);
    if (inverse == 0.0f) {  /* an inf or NaN: code_block on the numbers put back in order */
        float in_order[BLOCK];
        for (int j = 0; j < BLOCK; j += 64)
            for (int q = 0; q < 4; q++)
                for (int lane = 0; lane < 4; lane++)
                    for (int e = 0; e < 4; e++) in_order[j + interleaved(q, lane, e)] = x[j + 16 * q + 4 * lane + e];
        code_block(c->codes + begin, in_order, BLOCK, 1.0f / c->absmax[begin / BLOCK], c->lookup);
        return;
    }
    const __m512 scale = _mm512_set1_ps(inverse);
    const __m512i mirror = _mm512_set1_epi32((2 * c->fast->zero << FIXED) + (1 << FIXED) - 1);
    __m512i near = _mm512_set1_epi32(-1);
    for (int j = 0; j < BLOCK; j += 64) {
        __m512i codes[4];
        for (int q = 0; q < 4; q++) codes[q] = fixed16(s, _mm512_loadu_ps(x + j + 16 * q), scale, mirror, &near,
                                                                  is_signed);
        store_codes64(c->codes + begin + j, order2, codes);
    }
    if (any_near(near)) code_settled(c, s, order, begin, x, scale, is_signed);
}

#if defined(__GNUC__) && !defined(__clang__)
/* gcc schedules instructions before allocating registers only when asked (off by default on x86, for the
   register pressure). Its pressure-aware scheduler, on the fused loop only (split_blocks,
   into which the helpers above are inlined), orders it so that more of its long chains run side by side: 5% less time in
   cache here (the other loops gained nothing). The same instructions in another order: no arithmetic
   changes (-ffp-contract=off holds, nothing is reassociated). */
#pragma GCC push_options
#pragma GCC optimize("schedule-insns", "sched-pressure")
#define FAST_OPTIONS_PUSHED 1
#endif
/* The first half of a block: its moments decoded 64 at a time into registers and updated with its
   gradient (adamw()'s m and v lines, torch's vector formula for v), stored (interleaved) in m_new and v_new, and their |x| maxima. */
static inline __attribute__((always_inline)) void moments_of_block(const Constants *k, const int kind, const Coded *cm,
                                                                    const Coded *cv, __m512i decode_order,
                                                                    uint16_t *grad, const int empty_grad, int64_t at,
                                                                    float *restrict m_new, float *restrict v_new,
                                                                    __m512i *m_largest, __m512i *v_largest) {
    const __m512 m_scale = _mm512_set1_ps(cm->absmax[at / BLOCK]), v_scale = _mm512_set1_ps(cv->absmax[at / BLOCK]);
    const __m512i zero = _mm512_setzero_si512();
    for (int j = 0; j < BLOCK; j += 64) {
        __m512 m[4], v[4];
        decode64_into(cm->fast, decode_order, cm->codes + at + j, m_scale, m);
        decode64_into(cv->fast, decode_order, cv->codes + at + j, v_scale, v);
        for (int q = 0; q < 4; q += 2) {
            uint16_t *const gp = grad + at + j + 16 * q;
            const __m512i g = _mm512_loadu_si512(gp);
            if (empty_grad) _mm512_storeu_si512(gp, zero);
            __m512 grads[2] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, g)),
                               _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, g))};
            for (int h = 0; h < 2; h++) {
                __m512 gh = grads[h], *mh = &m[q + h], *vh = &v[q + h];
                if (kind & CLIPS) gh = _mm512_mul_ps(gh, k->clip);
                *mh = _mm512_fmadd_ps(k->coeff, _mm512_sub_ps(gh, *mh), kind & SMALL ? *mh : gh);
                *vh = _mm512_fmadd_ps(_mm512_mul_ps(k->one_minus_beta2, gh), gh, _mm512_mul_ps(*vh, k->beta2));
            }
        }
        for (int q = 0; q < 4; q++) {
            _mm512_storeu_ps(m_new + j + 16 * q, m[q]);
            _mm512_storeu_ps(v_new + j + 16 * q, v[q]);
            *m_largest = abs_max(*m_largest, m[q]);
            *v_largest = abs_max(*v_largest, v[q]);
        }
    }
}

/* adamw()'s denominator, sqrt(v) / bias2_sqrt + eps, of 32 numbers from their new v (interleaved). */
static inline __attribute__((always_inline)) void denominators32(const Constants *k, const float *v1,
                                                                  __m512 denominators[2]) {
    for (int h = 0; h < 2; h++)
        denominators[h] = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(_mm512_loadu_ps(v1 + 16 * h)), k->bias2_sqrt),
                                        k->eps);
}

/* adamw()'s master update on 32 numbers of the split layout (combine() first) from their new m
   (interleaved) and their denominators: the new fp32 masters, u. */
static inline __attribute__((always_inline)) void new_masters32(const Constants *k, const int kind,
                                                                 const uint16_t *weight, const int16_t *residual,
                                                                 const float *m1, const __m512 denominators[2],
                                                                 __m512i u[2]) {
    const __m512i w = _mm512_loadu_si512(weight), low = _mm512_loadu_si512(residual);
    const __m512i above = _mm512_add_epi16(w, _mm512_srai_epi16(low, 15));
    const __m512i masters[2] = {_mm512_unpacklo_epi16(low, above), _mm512_unpackhi_epi16(low, above)};
    for (int h = 0; h < 2; h++) {
        __m512 p = _mm512_castsi512_ps(masters[h]);
        const __m512 m = _mm512_loadu_ps(m1 + 16 * h);
        if (kind & DECAYS) p = _mm512_mul_ps(p, k->decay);
        u[h] = _mm512_castps_si512(_mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(k->step_size, m), denominators[h])));
    }
}

/* 32 new masters u narrow()ed into their bf16 weights and residuals, stored (and the weights in the shadow). */
static inline __attribute__((always_inline)) void store_masters32(const Orders *o, const __m512i u[2], uint16_t *weight,
                                                                   int16_t *residual, uint16_t *shadow) {
    __m512i weights, residuals;
    NARROW32(o, u, &weights, &residuals);
    _mm512_storeu_si512(weight, weights);
    if (shadow) _mm512_storeu_si512(shadow, weights);
    _mm512_storeu_si512(residual, residuals);
}

/* Whole blocks of the split layout with a bf16 gradient and 8-bit moments, from `at` while they end
   by `end` and before the scalar tail, in two passes over each block while it is in the L1: the new
   moments first (decoded, updated, their absmax), then the masters' update and the moments' coding
   side by side (both read only the new moments, so the core overlaps the divider's chain with the
   coding's lookups). Returns where it stopped. */
static inline __attribute__((always_inline)) int64_t split_blocks_of(const Run *r, const Hyper *h, int64_t at,
                                                                      int64_t end, const int kind) {
    const float coeff = kind & SMALL ? h->lerp_weight : h->lerp_weight - 1.0f;
    const Constants k = {_mm512_set1_ps(h->decay), _mm512_set1_ps(coeff),
                         _mm512_set1_ps(h->beta2), _mm512_set1_ps(h->one_minus_beta2), _mm512_set1_ps(h->bias2_sqrt),
                         _mm512_set1_ps(h->eps), _mm512_set1_ps(h->step_size), _mm512_set1_ps(h->clip)};
    const Coded *cm = &r->exp_avg_coded, *cv = &r->exp_avg_sq_coded;
    const Segments sm = segments_of(cm->fast), sv = segments_of(cv->fast);
    const __m512i decode_order = interleaved_order(), codes_in_order = code_order();
    const __m512i codes_in_order2 = _mm512_add_epi8(codes_in_order, _mm512_set1_epi8(2));  /* bits 16-23 */
    const Orders orders = {word_order(1), word_order(0), packed_order()};
    uint16_t *const weight = r->weight, *const shadow = r->shadow, *const grad = (uint16_t *)r->grad;
    int16_t *const residual = r->residual;
    const __m512i mirror = _mm512_set1_epi32((2 * cm->fast->zero << FIXED) + (1 << FIXED) - 1);
    const int64_t stop = end < r->vector_end ? end : r->vector_end;
    float m_new[BLOCK], v_new[BLOCK];  /* interleaved */
    if (cm->fast->zero == 0 || cv->fast->zero != 0) return at;  /* m on the signed map, v on the unsigned one */
    for (; at + BLOCK <= stop; at += BLOCK) {
        __m512i m_largest = _mm512_setzero_si512(), v_largest = _mm512_setzero_si512();
        moments_of_block(&k, kind, cm, cv, decode_order, grad, r->empty_grad, at, m_new, v_new, &m_largest,
                         &v_largest);
        const float m_inverse = scale_of(cm, at, m_largest), v_inverse = scale_of(cv, at, v_largest);
        const int finite = m_inverse != 0.0f && v_inverse != 0.0f;
        const __m512 m_scale = _mm512_set1_ps(m_inverse), v_scale = _mm512_set1_ps(v_inverse);
        __m512i m_near = _mm512_set1_epi32(-1), v_near = _mm512_set1_epi32(-1);
        /* The masters' chains and the coding's are spread over the loop in stages (the square roots
           and first division of group g + 1 issued beside group g's second division; a group's
           rounding and stores two groups later; a vector's segment lookup beside the previous
           vector's line): fewer of a chain's instructions wait in the core's queues for the ones
           before them, so more of them are in flight (9% less time in the L3 than each chain in its
           own order, benchmarks/docs/host_adam_bandwidth.md). A group is 32 numbers, 8 a block. */
        __m512 ahead[2];
        __m512i held[BLOCK / 32][2];  /* each group's new masters, stored two groups later */
        denominators32(&k, v_new, ahead);
        for (int j = 0; j < BLOCK; j += 64) {
            for (int g = j / 32; g < j / 32 + 2; g++) {
                const __m512 denominators[2] = {ahead[0], ahead[1]};
                if (32 * g + 32 < BLOCK) denominators32(&k, v_new + 32 * g + 32, ahead);
                new_masters32(&k, kind, weight + at + 32 * g, residual + at + 32 * g, m_new + 32 * g, denominators,
                              held[g]);
                if (g >= 2) store_masters32(&orders, held[g - 2], weight + at + 32 * (g - 2),
                                            residual + at + 32 * (g - 2), shadow ? shadow + at + 32 * (g - 2) : NULL);
            }
            if (!finite) continue;
            __m512i m_codes[4], v_codes[4];
            Scaled m_next = segment16(&sm, _mm512_loadu_ps(m_new + j), m_scale, 1);
            Scaled v_next = segment16(&sv, _mm512_loadu_ps(v_new + j), v_scale, 0);
            for (int q = 0; q < 4; q++) {
                const Scaled m_now = m_next, v_now = v_next;
                if (q < 3) {
                    m_next = segment16(&sm, _mm512_loadu_ps(m_new + j + 16 * q + 16), m_scale, 1);
                    v_next = segment16(&sv, _mm512_loadu_ps(v_new + j + 16 * q + 16), v_scale, 0);
                }
                m_codes[q] = line16(&sm, m_now, mirror, &m_near, 1);
                v_codes[q] = line16(&sv, v_now, mirror, &v_near, 0);
            }
            store_codes64(cm->codes + at + j, codes_in_order2, m_codes);
            store_codes64(cv->codes + at + j, codes_in_order2, v_codes);
        }
        for (int g = BLOCK / 32 - 2; g < BLOCK / 32; g++)
            store_masters32(&orders, held[g], weight + at + 32 * g, residual + at + 32 * g,
                            shadow ? shadow + at + 32 * g : NULL);
        if (!finite) {  /* an inf or NaN in a moment: each coded on its own (code_interleaved's own path) */
            code_interleaved(cm, &sm, codes_in_order, codes_in_order2, at, m_new, m_largest, 1);
            code_interleaved(cv, &sv, codes_in_order, codes_in_order2, at, v_new, v_largest, 0);
            continue;
        }
        if (any_near(m_near)) code_settled(cm, &sm, codes_in_order, at, m_new, m_scale, 1);
        if (any_near(v_near)) code_settled(cv, &sv, codes_in_order, at, v_new, v_scale, 0);
    }
    return at;
}

static int64_t split_blocks(const Run *r, const Hyper *h, int64_t at, int64_t end) {
    const int kind = (fabsf(h->lerp_weight) < 0.5f ? SMALL : 0) | (h->clip != 1.0f ? CLIPS : 0) |
                     (h->decay != 1.0f ? DECAYS : 0);
    switch (kind) {  /* one loop each, its branches decided when compiled */
        case 0: return split_blocks_of(r, h, at, end, 0);
        case 1: return split_blocks_of(r, h, at, end, 1);
        case 2: return split_blocks_of(r, h, at, end, 2);
        case 3: return split_blocks_of(r, h, at, end, 3);
        case 4: return split_blocks_of(r, h, at, end, 4);
        case 5: return split_blocks_of(r, h, at, end, 5);
        case 6: return split_blocks_of(r, h, at, end, 6);
        default: return split_blocks_of(r, h, at, end, 7);
    }
}
#ifdef FAST_OPTIONS_PUSHED
#pragma GCC pop_options
#endif
#else
#define HAVE_FAST 0
static void fast_decode(const Coded *c, int64_t begin, float *restrict out) { (void)c, (void)begin, (void)out; }
static void fast_encode(const Coded *c, int64_t begin, const float *restrict x) { (void)c, (void)begin, (void)x; }
static int64_t split_blocks(const Run *r, const Hyper *h, int64_t at, int64_t end) {
    (void)r, (void)h, (void)end;
    return at;
}
#endif

/* 1 when this library has the VBMI path (built with its flags: native/adamw.py asks first). */
int slimtune_fast_8bit(void) { return HAVE_FAST; }

/* numel fp32 numbers x coded into c, a block at a time, as the step codes its moments: what the tests
   hold against moments8's quantizer on the numbers that matter most (midpoints and their neighbours). */
int slimtune_encode(const Coded *c, int64_t numel, const float *x) {
    for (int64_t at = 0; at < numel; at += BLOCK) {
        const int64_t count = numel - at < BLOCK ? numel - at : BLOCK;
        if (c->fast && count == BLOCK) fast_encode(c, at, x + at);
        else encode(c, at, count, x + at);
    }
    return 0;
}

/* Numbers [begin, end) of the gradient zeroed, when the run empties it (while they are in cache). */
static void empty(const Run *r, int64_t begin, int64_t end) {
    if (!r->empty_grad) return;
    const size_t size = r->grad_bf16 ? 2 : 4;
    memset((char *)r->grad + begin * size, 0, (size_t)(end - begin) * size);
}

/* [begin, end) of a run with fp32 moments, CHUNK numbers at a time. */
static void slice_fp32(const Run *r, const Hyper *h, int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; at += CHUNK) {
        const int64_t stop = end - at < CHUNK ? end : at + CHUNK;
        both_paths(r, h, at, stop, r->exp_avg + at, r->exp_avg_sq + at);
        empty(r, at, stop);
    }
}

/* [begin, end) of a run with 8-bit moments (begin a multiple of BLOCK): a block at a time, its
   moments decoded into the cache, updated, and coded again. */
static void slice_coded(const Run *r, const Hyper *h, int64_t begin, int64_t end) {
    float m[BLOCK], v[BLOCK];
    const int fast = r->exp_avg_coded.fast && r->exp_avg_sq_coded.fast;
    if (fast && r->split && r->grad_bf16) begin = split_blocks(r, h, begin, end);
    for (int64_t at = begin; at < end; at += BLOCK) {
        const int64_t count = end - at < BLOCK ? end - at : BLOCK;
        if (fast && count == BLOCK) {
            fast_decode(&r->exp_avg_coded, at, m);
            fast_decode(&r->exp_avg_sq_coded, at, v);
            both_paths(r, h, at, at + count, m, v);
            empty(r, at, at + count);
            fast_encode(&r->exp_avg_coded, at, m);
            fast_encode(&r->exp_avg_sq_coded, at, v);
            continue;
        }
        decode(&r->exp_avg_coded, at, count, m);
        decode(&r->exp_avg_sq_coded, at, count, v);
        both_paths(r, h, at, at + count, m, v);
        empty(r, at, at + count);
        encode(&r->exp_avg_coded, at, count, m);
        encode(&r->exp_avg_sq_coded, at, count, v);
    }
}

static void slice(const Run *r, const Hyper *h, int64_t begin, int64_t end) {
    if (r->coded) slice_coded(r, h, begin, end);
    else slice_fp32(r, h, begin, end);
}

typedef struct {
    const Run *run;
    const Hyper *hyper;
    int64_t begin, end;
} Slice;

static void *slice_thread(void *arg) {
    const Slice *s = (const Slice *)arg;
    slice(s->run, s->hyper, s->begin, s->end);
    return NULL;
}

/* The step over the whole run, on r->threads threads (this one among them). Returns 0. */
int slimtune_adamw(const Run *r, const Hyper *h) {
    int threads = r->threads < 1 ? 1 : r->threads > MAX_THREADS ? MAX_THREADS : r->threads;
    int64_t per = (r->numel / threads + SLICE_ALIGN - 1) / SLICE_ALIGN * SLICE_ALIGN;
    if (threads == 1 || per == 0) {
        slice(r, h, 0, r->numel);
        return 0;
    }
    Slice slices[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 0; t < threads; t++) {
        int64_t begin = t * per, end = begin + per < r->numel ? begin + per : r->numel;
        slices[t] = (Slice){r, h, begin < r->numel ? begin : r->numel, end};
    }
    for (int t = 1; t < threads; t++) {  /* a thread that cannot start leaves its slice to this one */
        if (pthread_create(&ids[t], NULL, slice_thread, &slices[t]) != 0) break;
        started = t;
    }
    slice_thread(&slices[0]);
    for (int t = started + 1; t < threads; t++) slice_thread(&slices[t]);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
    return 0;
}
