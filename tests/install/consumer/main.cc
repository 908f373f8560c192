// Diffs two small tensors, encodes and applies the delta, round-trips a
// checkpoint and checksums the result, through the installed headers and
// libraries only. Exits 0 and prints "ok" when every result is the expected
// one.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "deltasync/checkpoint.h"
#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"

namespace {

int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: %s\n", what.c_str());
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace deltasync;
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer <scratch dir>\n");
    return 2;
  }
  // Published reference: Python's xxhash.xxh3_64(b"abc").hexdigest().
  const std::string abc = "abc";
  Check(ChecksumHex(ChecksumAlgo::kXxh3_64, std::span(reinterpret_cast<const uint8_t*>(abc.data()),
                                                      abc.size())) == "78af5f94892f3950",
        "xxh3-64 of 'abc' is not the published value");

  // Eight BF16 elements, two of which change.
  std::vector<uint8_t> old_bytes(16), new_bytes(16);
  for (size_t i = 0; i < old_bytes.size(); ++i) old_bytes[i] = new_bytes[i] = uint8_t(i);
  new_bytes[2] ^= 0x80;   // element 1
  new_bytes[13] ^= 0x01;  // element 6
  std::vector<uint8_t> snapshot = old_bytes;
  DiffOptions diff;
  diff.elem_size = 2;
  ChangeSet changes;
  Status s = DiffTensor(new_bytes, snapshot, diff, &changes);
  Check(s.ok(), "DiffTensor: " + s.ToString());
  Check(changes.count() == 2 && changes.position(0) == 1 && changes.position(1) == 6,
        "the diff does not find elements 1 and 6");
  Check(snapshot == new_bytes, "the diff did not refresh the snapshot");

  std::vector<uint8_t> encoded;
  s = Encode(Encoding::kXor, new_bytes, changes, EncodeOptions{}, &encoded);
  Check(s.ok(), "Encode: " + s.ToString());
  std::vector<uint8_t> target = old_bytes;
  s = DecodeApply(Encoding::kXor, encoded, target, 2);
  Check(s.ok(), "DecodeApply: " + s.ToString());
  Check(target == new_bytes, "applying the xor delta does not give the new tensor");

  const std::string dir = std::string(argv[1]) + "/checkpoint";
  s = WriteCheckpoint(dir, {TensorView{"w", DType::kBF16, {8}, new_bytes}});
  Check(s.ok(), "WriteCheckpoint: " + s.ToString());
  Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(dir);
  Check(opened.ok(), "Checkpoint::Open: " + opened.status().ToString());
  if (opened.ok()) {
    Result<TensorView> w = (*opened)->Get("w");
    Check(w.ok() && ChecksumHex(ChecksumAlgo::kXxh3_64, w->bytes) ==
                        ChecksumHex(ChecksumAlgo::kXxh3_64, new_bytes),
          "the checkpoint does not hold the tensor written");
  }
  if (failures != 0) return 1;
  std::printf("ok\n");
  return 0;
}
