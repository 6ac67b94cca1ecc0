// Known-answer tests of SHA-256 (FIPS 180-2 appendix B examples) and HMAC-SHA-256
// (RFC 4231 section 4, test cases 1-7).
#include "harness.h"
#include "smddp/common/sha256.h"

namespace smddp_test {
namespace {

std::string hex(const smddp::Digest& d, size_t bytes = 32) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes; ++i) {
    out.push_back(digits[d[i] >> 4]);
    out.push_back(digits[d[i] & 15]);
  }
  return out;
}

std::string bytes_of(std::initializer_list<int> v) {
  std::string s;
  for (int b : v) s.push_back(static_cast<char>(b));
  return s;
}

}  // namespace

TEST_CASE(sha256_fips180_examples) {
  using smddp::sha256;
  EXPECT(hex(sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
         hex(sha256("abc")));
  // The 448-bit message: padding spills into a second block.
  const std::string m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT(hex(sha256(m448)) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
         hex(sha256(m448)));
  // The 896-bit message (FIPS 180-4 example for SHA-256 with two message blocks).
  const std::string m896 =
      "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmn"
      "opqrsmnopqrstnopqrstu";
  EXPECT(hex(sha256(m896)) == "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
         hex(sha256(m896)));
  const std::string million(1000000, 'a');
  EXPECT(hex(sha256(million)) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0",
         hex(sha256(million)));
  EXPECT(hex(sha256("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
         hex(sha256("")));
}

TEST_CASE(hmac_sha256_rfc4231) {
  using smddp::hmac_sha256;
  struct Tc {
    int number;
    std::string key, data, mac;
    size_t bytes;  // compared prefix (case 5 is truncated to 128 bits)
  };
  const std::string aa131(131, '\xaa');
  const std::vector<Tc> cases = {
      {1, std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", 32},
      {2, "Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", 32},
      {3, std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe", 32},
      {4, bytes_of({0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d,
                    0x0e, 0x0f, 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19}),
       std::string(50, '\xcd'), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
       32},
      {5, std::string(20, '\x0c'), "Test With Truncation", "a3b6167473100ee06e0c796c2955552b", 16},
      {6, aa131, "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", 32},
      {7, aa131,
       "This is a test using a larger than block-size key and a larger than block-size data. The "
       "key needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", 32},
  };
  for (const Tc& tc : cases) {
    const std::string got = hex(hmac_sha256(tc.key, tc.data), tc.bytes);
    EXPECT(got == tc.mac, "RFC 4231 test case ", tc.number, ": ", got);
  }
}

TEST_CASE(digest_equal_compares_every_byte) {
  smddp::Digest a = smddp::sha256("x"), b = a;
  EXPECT(smddp::digest_equal(a, b));
  for (size_t i : {size_t(0), size_t(17), size_t(31)}) {
    b = a;
    b[i] ^= 1;
    EXPECT(!smddp::digest_equal(a, b), "byte ", i);
  }
}

}  // namespace smddp_test
