// Portable "vector" of 8 floats for isa_kernels.h (plain loops the compiler may vectorize for the
// baseline ISA). A fragment: isa_generic.cpp includes it inside its own namespace.

struct Vec {
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  static constexpr bool kDenseD16 = false;
  static constexpr bool kBf16Dot = false;  // no bf16 dot product instruction
  struct F {
    float v[8];
  };
  struct I {
    int32_t v[8];
  };

  static F zero() { return set1(0.0f); }
  static F set1(float x) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static F load(const T* p) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  template <typename T>
  static void store(T* p, F x) {
    for (int i = 0; i < W; ++i) from_float(x.v[i], p + i);
  }
  static F fmadd(F a, F b, F c) {
    for (int i = 0; i < W; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i];
    return c;
  }
  static F mul(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static F add(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static F sub(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static F max(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  static float lane0(F x) { return x.v[0]; }

  static F exp2(F x) {
    for (int i = 0; i < W; ++i) x.v[i] = x.v[i] < -126.0f ? 0.0f : std::exp2(x.v[i]);
    return x;
  }
  static F replace_neginf(F x, float v) {
    for (int i = 0; i < W; ++i) {
      if (x.v[i] == -HUGE_VALF) x.v[i] = v;
    }
    return x;
  }
  static bool all_equal(F a, F b) {
    for (int i = 0; i < W; ++i) {
      if (!(a.v[i] == b.v[i])) return false;
    }
    return true;
  }
  static F reduce(const F* a) {
    F r;
    for (int u = 0; u < W; ++u) {
      float s = 0.0f;
      for (int i = 0; i < W; ++i) s += a[u].v[i];
      r.v[u] = s;
    }
    return r;
  }
  static F rotate(F x, int s) {
    F r;
    for (int u = 0; u < W; ++u) r.v[u] = x.v[(u + s) % W];
    return r;
  }
  static I iload(const int32_t* p) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static I iset1(int32_t x) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static I iadd(I a, I b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static F mask_range(F x, I key, I lo, I hi) {
    for (int i = 0; i < W; ++i) {
      if (key.v[i] < lo.v[i] || key.v[i] >= hi.v[i]) x.v[i] = -HUGE_VALF;
    }
    return x;
  }
  static I load_bits(const bf16_t*) { return iset1(0); }
  static F dot_bf16(F acc, const bf16_t*, I) { return acc; }
  static F dot_bf16_pairs(F acc, I, I) { return acc; }
};
