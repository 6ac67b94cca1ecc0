// SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104), used to authenticate TCP mesh
// connections with the per-group secret without ever sending the secret itself.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace smddp {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const std::string& data);
Digest hmac_sha256(const std::string& key, const std::string& message);

// Constant-time comparison.
bool digest_equal(const Digest& a, const Digest& b);

}  // namespace smddp
