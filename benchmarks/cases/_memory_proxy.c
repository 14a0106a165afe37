/* benchmarks/cases/memory_proxy.py's program: the 8-bit host AdamW's five streams (bf16 weight,
   residual and gradient, two code streams; 16 bytes a number read and written in place) with a body
   of chosen density, timed on 2^25 numbers (in DRAM) and on 2^16 (in the L2), with 4 KiB pages and
   with madvise(MADV_HUGEPAGE), beside a memcpy of 2^25 fp32. One JSON object on stdout.

   usage: memory_proxy BODY WORK AHEAD HINT
     BODY  trivial | divides | dense: no arithmetic, WORK dependent divisions a 32 numbers, or WORK
           rounds of four chains (permute, add, max, xor) beside one division
     AHEAD software prefetch of every stream this many 256-number blocks ahead (0: none)
     HINT  0: prefetcht0 (to the L1), 1: prefetcht1 (to the L2) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { TRIVIAL, DIVIDES, DENSE };
static int body, work, ahead, hint;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void prefetch(const void *p) {
    if (hint) _mm_prefetch((const char *)p, _MM_HINT_T1);
    else _mm_prefetch((const char *)p, _MM_HINT_T0);
}

static __m512i arithmetic(__m512i x, __m512i y, __m512i z) {
    if (body == TRIVIAL) return x;
    const __m512 d = _mm512_set1_ps(1.0001f);
    __m512 f = _mm512_castsi512_ps(_mm512_unpacklo_epi16(y, x));
    if (body == DIVIDES) {
        for (int k = 0; k < work; k++) f = _mm512_div_ps(f, d);
    } else {
        __m512i q0 = x, q1 = y, q2 = z, q3 = _mm512_xor_si512(x, y);
        for (int k = 0; k < work; k++) {
            q0 = _mm512_permutexvar_epi32(q1, q0), q1 = _mm512_add_epi32(q1, q2);
            q2 = _mm512_max_epi32(q2, q3), q3 = _mm512_xor_si512(q3, q0);
            __asm__ volatile("" : "+v"(q0), "+v"(q1), "+v"(q2), "+v"(q3));  /* every round issued */
        }
        f = _mm512_div_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(f),
                                                                _mm512_xor_si512(q0, _mm512_xor_si512(q1, q2)))), d);
    }
    return _mm512_add_epi16(x, _mm512_srli_epi32(_mm512_castps_si512(f), 16));
}

typedef struct { uint16_t *w, *r, *g; uint8_t *mc, *vc; } Streams;

static __attribute__((noinline)) void update(int64_t n, const Streams *s) {
    for (int64_t at = 0; at < n; at += 256) {
        if (ahead && at + (ahead + 1) * 256 <= n) {
            const int64_t next = at + ahead * 256;
            for (int line = 0; line < 512; line += 64) {
                prefetch((const char *)(s->g + next) + line), prefetch((const char *)(s->w + next) + line);
                prefetch((const char *)(s->r + next) + line);
            }
            for (int line = 0; line < 256; line += 64)
                prefetch(s->mc + next + line), prefetch(s->vc + next + line);
        }
        for (int j = 0; j < 256; j += 64) {
            _mm512_storeu_si512(s->mc + at + j, _mm512_add_epi8(_mm512_loadu_si512(s->mc + at + j), _mm512_set1_epi8(1)));
            _mm512_storeu_si512(s->vc + at + j, _mm512_add_epi8(_mm512_loadu_si512(s->vc + at + j), _mm512_set1_epi8(1)));
        }
        for (int j = 0; j < 256; j += 32) {
            const __m512i x = _mm512_loadu_si512(s->w + at + j), y = _mm512_loadu_si512(s->r + at + j);
            const __m512i z = _mm512_loadu_si512(s->g + at + j);
            _mm512_storeu_si512(s->w + at + j, _mm512_add_epi16(arithmetic(x, y, z), z));
            _mm512_storeu_si512(s->r + at + j, _mm512_add_epi16(y, _mm512_set1_epi16(1)));
            _mm512_storeu_si512(s->g + at + j, _mm512_setzero_si512());
        }
    }
}

static void *pages(size_t bytes, int huge) {
    const size_t align = 2u << 20;
    char *p = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    p = (char *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 1, bytes);
    return p;
}

static double best_ns(const Streams *s, int64_t n, int calls) {
    double best = 1e9;
    for (int k = 0; k < calls; k++) {
        const double t = now();
        update(n, s);
        const double dt = now() - t;
        if (dt < best) best = dt;
    }
    return best / n * 1e9;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: memory_proxy trivial|divides|dense WORK AHEAD HINT\n"); return 2; }
    body = !strcmp(argv[1], "divides") ? DIVIDES : !strcmp(argv[1], "dense") ? DENSE : TRIVIAL;
    work = atoi(argv[2]), ahead = atoi(argv[3]), hint = atoi(argv[4]);
    const int64_t big = (int64_t)1 << 25, small = 1 << 16;
    Streams s[2];
    for (int h = 0; h < 2; h++)
        s[h] = (Streams){pages(2 * big, h), pages(2 * big, h), pages(2 * big, h), pages(big, h), pages(big, h)};
    float *a = pages(4 * big, 0), *b = pages(4 * big, 0);
    double dram[2] = {1e9, 1e9}, cache[2] = {1e9, 1e9}, copy = 1e9;
    for (int round = 0; round < 3; round++) {
        for (int h = 0; h < 2; h++) {
            const double d = best_ns(&s[h], big, 2), c = best_ns(&s[h], small, 64);
            if (d < dram[h]) dram[h] = d;
            if (c < cache[h]) cache[h] = c;
        }
        const double t = now();
        memcpy(b, a, 4 * big);
        const double dt = now() - t;
        if (dt < copy) copy = dt;
    }
    printf("{\"dram_ns\": %.4f, \"cache_ns\": %.4f, \"dram_ns_huge_pages\": %.4f, \"cache_ns_huge_pages\": %.4f, "
           "\"memcpy_gbps\": %.2f}\n", dram[0], cache[0], dram[1], cache[1], 8.0 * big / copy / 1e9);
    return 0;
}
