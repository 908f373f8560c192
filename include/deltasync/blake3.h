// BLAKE3 (https://github.com/BLAKE3-team/BLAKE3-specs): hash, keyed hash and
// key derivation, with extendable output of any length.
//
// The hot path hashes multi-megabyte tensors, so whole 1 KiB chunks are
// compressed in batches straight from the caller's buffer (eight at a time
// with AVX2 when the CPU has it); only up to 8 KiB of input is ever copied.
// Every kernel produces identical output; the kernel only changes the speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "deltasync/status.h"

namespace deltasync {

class Blake3 {
 public:
  static constexpr size_t kKeyLen = 32;
  static constexpr size_t kOutLen = 32;
  static constexpr size_t kBlockLen = 64;
  static constexpr size_t kChunkLen = 1024;

  // The compression kernels Update can use for whole chunks.
  enum class Kernel : uint8_t {
    kPortable = 0,  // plain C++, one block at a time; available everywhere
    kAvx2 = 1,      // eight chunks (or parent nodes) at once in 256-bit lanes
  };

  // Plain hash mode.
  Blake3();
  // Keyed hash mode with a 32-byte key.
  static Blake3 Keyed(std::span<const uint8_t, kKeyLen> key);
  // Key derivation mode: the context string is hashed first, as the spec
  // says; the key material is then fed with Update. The context should be a
  // hard-coded, globally unique, application-specific string.
  static Blake3 DeriveKey(std::string_view context);

  // Absorbs `data`. Feeding the same bytes in any split yields the same
  // output as feeding them at once.
  void Update(std::span<const uint8_t> data);
  // Writes out.size() bytes of output (any length: the XOF). The first 32
  // bytes are the default-length digest; a shorter output is a prefix of a
  // longer one. Does not change the state, so it can be called again or after
  // more Update calls.
  void Finalize(std::span<uint8_t> out) const;
  // Back to the empty-input state of the same mode and key. Keeps the kernel.
  void Reset();

  // Whether this CPU (and OS) can run `kernel`.
  static bool KernelSupported(Kernel kernel);
  // The fastest supported kernel; new hashers start with it.
  static Kernel BestKernel();
  // The kernel this hasher uses for whole chunks.
  Kernel kernel() const { return kernel_; }
  // Pins this hasher to `kernel`, e.g. to test one kernel against another.
  // InvalidArgument for a value that names no kernel, Unsupported when this
  // CPU cannot run it; on error the current kernel stays.
  Status SetKernel(Kernel kernel);

 private:
  // At most 2^64 bytes of input: 2^54 chunks, so at most 54 pending subtrees.
  static constexpr size_t kMaxStackDepth = 54;
  // Input is buffered until more than this many chunks are known, so that
  // even small Update calls fill all eight AVX2 lanes.
  static constexpr size_t kBufferedChunks = 8;

  Blake3(const uint32_t key_words[8], uint8_t mode_flags);

  // Hashes `count` whole chunks that are known not to be the last: the first
  // `first_count` at `first`, the rest at `rest`, and adds them to the tree.
  void HashWholeChunks(const uint8_t* first, size_t first_count, const uint8_t* rest, size_t count);
  // Adds `count` chunk chaining values (32 bytes each, consecutive chunk
  // indices from chunk_counter_) to the tree, in aligned power-of-two
  // subtrees reduced with the kernel.
  void AddChunkCvs(uint8_t* cvs, size_t count);
  // Adds the chaining value of a complete subtree of 2^level chunks starting
  // at chunk_counter_ (a multiple of 2^level), merging completed siblings:
  // the stack then holds one entry per set bit of the chunk count, as in the
  // spec's incremental tree.
  void PushSubtreeCv(const uint8_t cv[32], unsigned level);
  // The output of a hasher whose buffer holds at most the final chunk.
  void FinalizeLastChunk(std::span<uint8_t> out) const;

  uint32_t key_[8];
  uint8_t mode_flags_;  // 0, KEYED_HASH or one of the DERIVE_KEY flags
  Kernel kernel_;
  // Index of the first buffered chunk; equals the number of chunks whose
  // chaining values already went into the stack.
  uint64_t chunk_counter_;
  // Input not yet compressed. Its last chunk might end the input, and so be
  // the root, until more input arrives.
  uint8_t buffer_[kBufferedChunks * kChunkLen];
  size_t buffer_len_;
  // Chaining values (little-endian bytes) of completed subtrees, largest
  // first.
  uint8_t cv_stack_[kMaxStackDepth][32];
  uint8_t cv_stack_len_;
};

}  // namespace deltasync
