// BLAKE3 (https://github.com/BLAKE3-team/BLAKE3-specs): hash, keyed hash and
// key derivation, with extendable output of any length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace deltasync {

class Blake3 {
 public:
  static constexpr size_t kKeyLen = 32;
  static constexpr size_t kOutLen = 32;
  static constexpr size_t kBlockLen = 64;
  static constexpr size_t kChunkLen = 1024;

  // Plain hash mode.
  Blake3();
  // Keyed hash mode with a 32-byte key.
  static Blake3 Keyed(std::span<const uint8_t, kKeyLen> key);
  // Key derivation mode: the context string is hashed first, as the spec says.
  static Blake3 DeriveKey(std::string_view context);

  void Update(std::span<const uint8_t> data);
  // Writes out.size() bytes of output (any length: the XOF). Does not change
  // the state, so it can be called again or after more Update calls.
  void Finalize(std::span<uint8_t> out) const;
  // Back to the empty-input state of the same mode and key.
  void Reset();

 private:
  Blake3(const uint32_t key_words[8], uint32_t flags);

  void PushChunkCv(const uint32_t cv[8], uint64_t total_chunks);

  uint32_t key_[8];
  uint32_t base_flags_;
  // Current chunk.
  uint32_t chunk_cv_[8];
  uint64_t chunk_counter_;
  uint8_t block_[kBlockLen];
  uint8_t block_len_;
  uint8_t blocks_compressed_;
  // Stack of chaining values of completed subtrees (at most 54 for 2^64 bytes).
  uint32_t cv_stack_[54][8];
  uint8_t cv_stack_len_;
};

}  // namespace deltasync
