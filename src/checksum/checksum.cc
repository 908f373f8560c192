#include "deltasync/checksum.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
// Routes the XXH3 bulk functions to the library's run-time dispatch (AVX2 or
// AVX-512 where the CPU has them; the plain build is SSE2). Digests are the
// same on every path.
#include <xxh_x86dispatch.h>
#endif
#include <zlib.h>

#include <cerrno>
#include <limits>

#include "deltasync/blake3.h"

namespace deltasync {
namespace {

class Xxh3_64Hasher final : public Hasher {
 public:
  Xxh3_64Hasher() : state_(XXH3_createState()) { Reset(); }
  ~Xxh3_64Hasher() override { XXH3_freeState(state_); }
  ChecksumAlgo algo() const override { return ChecksumAlgo::kXxh3_64; }
  void Update(std::span<const uint8_t> data) override {
    XXH3_64bits_update(state_, data.data(), data.size());
  }
  std::vector<uint8_t> Digest() const override {
    XXH64_canonical_t canon;
    XXH64_canonicalFromHash(&canon, XXH3_64bits_digest(state_));
    return {canon.digest, canon.digest + sizeof(canon.digest)};
  }
  void Reset() override { XXH3_64bits_reset(state_); }

 private:
  XXH3_state_t* state_;
};

class Xxh3_128Hasher final : public Hasher {
 public:
  Xxh3_128Hasher() : state_(XXH3_createState()) { Reset(); }
  ~Xxh3_128Hasher() override { XXH3_freeState(state_); }
  ChecksumAlgo algo() const override { return ChecksumAlgo::kXxh3_128; }
  void Update(std::span<const uint8_t> data) override {
    XXH3_128bits_update(state_, data.data(), data.size());
  }
  std::vector<uint8_t> Digest() const override {
    // The canonical form is big-endian high64 then low64: exactly the byte
    // order of Python's xxh3_128().hexdigest().
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state_));
    return {canon.digest, canon.digest + sizeof(canon.digest)};
  }
  void Reset() override { XXH3_128bits_reset(state_); }

 private:
  XXH3_state_t* state_;
};

class Blake3Hasher final : public Hasher {
 public:
  ChecksumAlgo algo() const override { return ChecksumAlgo::kBlake3; }
  void Update(std::span<const uint8_t> data) override { b3_.Update(data); }
  std::vector<uint8_t> Digest() const override {
    std::vector<uint8_t> out(Blake3::kOutLen);
    b3_.Finalize(out);
    return out;
  }
  void Reset() override { b3_.Reset(); }

 private:
  Blake3 b3_;
};

class Adler32Hasher final : public Hasher {
 public:
  ChecksumAlgo algo() const override { return ChecksumAlgo::kAdler32; }
  void Update(std::span<const uint8_t> data) override {
    // zlib takes uInt lengths; feed huge buffers in pieces.
    const uint8_t* p = data.data();
    size_t left = data.size();
    while (left) {
      const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
      value_ = adler32(value_, p, n);
      p += n;
      left -= n;
    }
  }
  std::vector<uint8_t> Digest() const override {
    return {static_cast<uint8_t>(value_ >> 24), static_cast<uint8_t>(value_ >> 16),
            static_cast<uint8_t>(value_ >> 8), static_cast<uint8_t>(value_)};
  }
  void Reset() override { value_ = adler32(0L, Z_NULL, 0); }

 private:
  uLong value_ = adler32(0L, Z_NULL, 0);
};

}  // namespace

std::string_view ChecksumAlgoName(ChecksumAlgo algo) {
  switch (algo) {
    case ChecksumAlgo::kXxh3_64: return "xxh3-64";
    case ChecksumAlgo::kXxh3_128: return "xxh3-128";
    case ChecksumAlgo::kBlake3: return "blake3";
    case ChecksumAlgo::kAdler32: return "adler32";
  }
  return "unknown";
}

Result<ChecksumAlgo> ParseChecksumAlgo(std::string_view name) {
  for (ChecksumAlgo a : {ChecksumAlgo::kXxh3_64, ChecksumAlgo::kXxh3_128, ChecksumAlgo::kBlake3,
                         ChecksumAlgo::kAdler32}) {
    if (ChecksumAlgoName(a) == name) return a;
  }
  return Status::Unsupported("unknown checksum algorithm '" + std::string(name) +
                             "' (expected xxh3-64, xxh3-128, blake3 or adler32)");
}

size_t ChecksumDigestSize(ChecksumAlgo algo) {
  switch (algo) {
    case ChecksumAlgo::kXxh3_64: return 8;
    case ChecksumAlgo::kXxh3_128: return 16;
    case ChecksumAlgo::kBlake3: return 32;
    case ChecksumAlgo::kAdler32: return 4;
  }
  return 0;
}

std::string Hasher::HexDigest() const { return ToHex(Digest()); }

std::unique_ptr<Hasher> NewHasher(ChecksumAlgo algo) {
  switch (algo) {
    case ChecksumAlgo::kXxh3_64: return std::make_unique<Xxh3_64Hasher>();
    case ChecksumAlgo::kXxh3_128: return std::make_unique<Xxh3_128Hasher>();
    case ChecksumAlgo::kBlake3: return std::make_unique<Blake3Hasher>();
    case ChecksumAlgo::kAdler32: return std::make_unique<Adler32Hasher>();
  }
  return nullptr;
}

std::vector<uint8_t> ChecksumBytes(ChecksumAlgo algo, std::span<const uint8_t> data) {
  std::unique_ptr<Hasher> h = NewHasher(algo);
  h->Update(data);
  return h->Digest();
}

std::string ChecksumHex(ChecksumAlgo algo, std::span<const uint8_t> data) {
  return ToHex(ChecksumBytes(algo, data));
}

std::string ToHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(bytes.size() * 2, '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

Result<std::string> ChecksumFileHex(ChecksumAlgo algo, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::FromErrno(err, path);
  }
  std::unique_ptr<Hasher> h = NewHasher(algo);
  std::vector<uint8_t> buf(1u << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(err, path);
    }
    if (n == 0) break;
    h->Update({buf.data(), static_cast<size_t>(n)});
  }
  ::close(fd);
  return h->HexDigest();
}

}  // namespace deltasync
