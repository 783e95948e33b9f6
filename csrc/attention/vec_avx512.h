// AVX-512 vector of 16 floats for isa_kernels.h. A fragment: isa_avx512.cpp includes it inside
// its own namespace, under `#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")`;
// isa_avx512bf16.cpp too, with avx512bf16 added and VATTN_AVX512_BF16 defined; isa_amx.cpp with
// AMX added but without VATTN_AVX512_BF16 (its vector code takes no bf16 dot product).
// (No include guard and no #include: <immintrin.h> and convert.h come first in that file.)

struct Vec {
  static constexpr int W = 16;
  static constexpr int kRegs = 32;
  static constexpr bool kDenseD16 = false;
  using F = __m512;
  using I = __m512i;

#ifdef VATTN_AVX512_BF16
  // AVX512-BF16 (isa_avx512bf16.cpp): acc lane i += a[2i] * b[2i] + a[2i + 1] * b[2i + 1] over 32
  // bf16 values (products exact, fp32 accumulation).
  static constexpr bool kBf16Dot = true;
  static I load_bits(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static F dot_bf16_pairs(F acc, I a, I b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  static F dot_bf16(F acc, const bf16_t* a, I b) { return dot_bf16_pairs(acc, load_bits(a), b); }
#else
  static constexpr bool kBf16Dot = false;
  static I load_bits(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static F dot_bf16(F acc, const bf16_t*, I) { return acc; }
  static F dot_bf16_pairs(F acc, I, I) { return acc; }
#endif

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float lane0(F x) { return _mm512_cvtss_f32(x); }

  // Element loads, converted to fp32 (exactly).
  static F load(const bf16_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load(const f16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load(const e5m2_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));  // e5m2 is the top byte of an fp16
  }
  static F load(const e4m3_t* p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    // normal: exponent e + 120, mantissa << 20; subnormal (e == 0): man * 2^-9 (integer
    // arithmetic and an exact int->float conversion: no dependence on DAZ)
    const __m512i normal =
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
    const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
    __m512 v = _mm512_mask_mov_ps(_mm512_castsi512_ps(normal), is_sub, sub);
    v = _mm512_mask_mov_ps(v, is_nan, _mm512_set1_ps(__builtin_nanf("")));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
  }

  // fp32 -> element stores (round to nearest even).
  static void store(bf16_t* p, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store(f16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  // 2^x for x <= 0 (x may be -inf); exactly 0 below -126. Relative error ~2e-7.
  static F exp2(F x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const F n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
    F p = _mm512_set1_ps(1.53467074e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33999391e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61848535e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55032864e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226462e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147182e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
  }

  // x with -inf lanes replaced by v.
  static F replace_neginf(F x, float v) {
    const __mmask16 m = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(x, m, _mm512_set1_ps(v));
  }
  static bool all_equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ) == 0; }

  // Lane u of the result = sum of the 16 lanes of a[u].
  static F reduce(const F* a) {
    F b[8], c[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const F f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const F f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // Lane u of the result = lane (u + s) mod 16 of x.
  static F rotate(F x, int s) {
    const __m512i idx = _mm512_and_si512(
        _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(s)),
        _mm512_set1_epi32(15));
    return _mm512_permutexvar_ps(idx, x);
  }

  // x where lo[u] <= key[u] < hi[u], else -inf (int32 lanes).
  static I iload(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I iset1(int32_t v) { return _mm512_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static F mask_range(F x, I key, I lo, I hi, F out = _mm512_set1_ps(-__builtin_inff())) {
    const __mmask16 ok = _mm512_cmpge_epi32_mask(key, lo) & _mm512_cmplt_epi32_mask(key, hi);
    return _mm512_mask_mov_ps(out, ok, x);
  }
};
