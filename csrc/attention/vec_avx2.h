// AVX2 + FMA + F16C vector of 8 floats for isa_kernels.h. A fragment: isa_avx2.cpp includes it
// inside its own namespace, under `#pragma GCC target("avx2,fma,f16c")`.

struct Vec {
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  static constexpr bool kDenseD16 = true;  // isa_kernels.h: dense QK^T tiles at d = 16 vectors
  static constexpr bool kBf16Dot = false;  // no bf16 dot product instruction
  using F = __m256;
  using I = __m256i;

  static I load_bits(const bf16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static F dot_bf16(F acc, const bf16_t*, I) { return acc; }
  static F dot_bf16_pairs(F acc, I, I) { return acc; }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float lane0(F x) { return _mm256_cvtss_f32(x); }

  static F load(const bf16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load(const f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F load(const e5m2_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  }
  static F load(const e4m3_t* p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256i normal =
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
    v = _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), is_nan);
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
  }

  static void store(bf16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // pack the 8 low halves: 32-bit lanes -> 16-bit (values < 2^16: packus is exact)
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
  }
  static void store(f16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static F exp2(F x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const F n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm256_sub_ps(x, n);
    F p = _mm256_set1_ps(1.53467074e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.33999391e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61848535e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55032864e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40226462e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147182e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }

  static F replace_neginf(F x, float v) {
    const __m256 m = _mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
    return _mm256_blendv_ps(x, _mm256_set1_ps(v), m);
  }
  static bool all_equal(F a, F b) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_UQ)) == 0;
  }

  static F reduce(const F* a) {
    const F h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
    const F h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
    const F k0 = _mm256_hadd_ps(h0, h1), k1 = _mm256_hadd_ps(h2, h3);
    return _mm256_add_ps(_mm256_permute2f128_ps(k0, k1, 0x20),
                         _mm256_permute2f128_ps(k0, k1, 0x31));
  }

  static F rotate(F x, int s) {
    const __m256i idx = _mm256_and_si256(
        _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(s)),
        _mm256_set1_epi32(7));
    return _mm256_permutevar8x32_ps(x, idx);
  }

  static I iload(const int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static I iset1(int32_t v) { return _mm256_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static F mask_range(F x, I key, I lo, I hi) {
    // key >= lo  <=>  !(lo > key);  key < hi  <=>  hi > key
    const __m256i ok =
        _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, key), _mm256_cmpgt_epi32(hi, key));
    return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), x, _mm256_castsi256_ps(ok));
  }
};
