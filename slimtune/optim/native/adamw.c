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
   tables), so they too leave the tile path's bits.

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

/* An 8-bit moment (moments8.Moment8) and its lookup tables (moments8's, by signedness). */
typedef struct {
    uint8_t *codes;        /* a code a number */
    float *absmax;         /* a scale a block of BLOCK numbers */
    const float *map;      /* the 256 values codes stand for (times the absmax) */
    const uint32_t *lookup; /* by bucket (a number's top 16 bits): moments8's base code (bits 0-7), the
                               low 16 bits of the bucket's midpoint (8-23), whether it has one (24) */
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

#define AT(pointer) ((pointer) ? (pointer) + at : NULL)
#define SPAN(split, bf16, shadows)                                                                    \
    span(count, *h, AT(r->master), AT(r->weight), AT(r->residual), AT(r->shadow), AT((uint16_t *)r->grad), \
         AT((float *)r->grad), m, v, split, bf16, shadows, scalar)

/* Numbers [at, at + count) of the run on torch's vector formula, with their moments in m and v
   (fp32, at their first): one vectorized loop per layout. */
static inline __attribute__((always_inline)) void vector_span(const Run *r, const Hyper *h, int64_t at,
                                                              int64_t count, float *m, float *v) {
    if (count <= 0) return;
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
    for (int64_t j = 0; j < count; j++) out[j] = c->map[codes[j]] * absmax;  /* hardware gathers: slower */
}

/* Each x times `inverse` takes the code of its 16-bit bucket, plus one above the bucket's midpoint
   (moments8's rule). A midpoint lies inside its bucket, so it shares the number's sign and top bits,
   and "above" is a compare of the low 16 bits: greater for a positive number, smaller for a negative
   one; so one table of int32 entries serves, which gcc vectorizes with one gather a number. */
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

/* numel fp32 numbers x coded into c, a block at a time, as the step codes its moments: what the tests
   hold against moments8's quantizer on the numbers that matter most (midpoints and their neighbours). */
int slimtune_encode(const Coded *c, int64_t numel, const float *x) {
    for (int64_t at = 0; at < numel; at += BLOCK) encode(c, at, numel - at < BLOCK ? numel - at : BLOCK, x + at);
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
    for (int64_t at = begin; at < end; at += BLOCK) {
        const int64_t count = end - at < BLOCK ? end - at : BLOCK;
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
