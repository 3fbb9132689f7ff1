#pragma once
/// CFMO_SIMD_CLONES compiles a hot element-wise loop for AVX-512, AVX2 and
/// the baseline ISA; the loader picks by CPU feature. One portable binary,
/// full vector width where the machine has it. Results are bit-identical
/// across clones: ISO C++ mode disables FMA contraction (-ffp-contract=off).
/// Not under ThreadSanitizer (-Db_sanitize=thread): it instruments the
/// clones' resolvers, which the loader runs before its runtime exists.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define CFMO_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CFMO_SIMD_CLONES
#endif
