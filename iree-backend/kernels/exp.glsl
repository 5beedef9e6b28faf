// e^x as the AVX-512 kernels take it (`exp16` in avx512.c): 2^n e^r with n = round(x / ln 2)
// and r = x - n ln 2 (ln 2 in two parts, the first exact in n * C1), e^r by its Taylor series
// to degree 7. Below -104 the result is 0 or the smallest subnormal (0 where the device flushes
// subnormals). The same arithmetic on every driver, where GLSL's `exp` may lose 3 + 2 |x| ulp.
float exp_poly(float x) {
  x = clamp(x, -104.0, 88.7);
  const float n = roundEven(x * 1.44269504088896341);
  float r = fma(-n, 0.693359375, x);
  r = fma(-n, -2.12194440e-4, r);
  float p = 1.0 / 5040.0;
  p = fma(p, r, 1.0 / 720.0);
  p = fma(p, r, 1.0 / 120.0);
  p = fma(p, r, 1.0 / 24.0);
  p = fma(p, r, 1.0 / 6.0);
  p = fma(p, r, 0.5);
  p = fma(p, r, 1.0);
  p = fma(p, r, 1.0);
  return ldexp(p, int(n));
}
