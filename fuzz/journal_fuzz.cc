// libFuzzer target for the apply journal (src/store/journal.h).
//
// The first input byte picks the mode:
//  - raw (bit 0 clear): the rest is a journal file. Open and
//    OpenIntactPrefix must agree (a journal Open accepts reads as the same
//    complete journal through OpenIntactPrefix, with or without a pool), and
//    every record read must be safe to apply: applied to an exact-size heap
//    buffer (so ASan sees any access outside it), one at a time and grouped
//    per tensor as recovery applies them, it must give what a plain
//    reference scatter gives, and hand its pieces over in order, each final.
//  - written (bit 0 set): the rest describes records, which JournalWriter
//    writes (with or without the trailer); then the file is cut short and a
//    few bytes are flipped, at positions the input picks. OpenIntactPrefix
//    must return exactly the records that lie wholly before the first
//    damaged byte, each as written, and call the journal complete only when
//    it was finished and nothing was damaged.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/thread_pool.h"
#include "fuzz_util.h"
#include "store/journal.h"

namespace {

using deltasync::ChangeSet;
using deltasync::Result;
using deltasync::Status;
using deltasync::fuzz_util::Require;
using deltasync::store_internal::Journal;
using deltasync::store_internal::JournalRecord;
using deltasync::store_internal::JournalWriter;

// Records covering more bytes than this are checked but not applied.
constexpr uint64_t kMaxApplyBytes = 1 << 16;

class InputReader {
 public:
  InputReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Next() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint32_t Next16() { return Next() | uint32_t{Next()} << 8; }
  uint32_t Next32() { return Next16() | Next16() << 16; }
  std::span<const uint8_t> Rest() const { return {data_ + pos_, size_ - pos_}; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

deltasync::ThreadPool& Pool() {
  static deltasync::ThreadPool pool(2);
  return pool;
}

const std::string& JournalPath() {
  static deltasync::fuzz_util::ScratchDir dir("ds_journal_fuzz");
  static const std::string path = dir.Join("journal");
  return path;
}

// Whether a record's bytes may be allocated and applied (numel * elem_size
// without overflow, and small).
bool Small(const JournalRecord& r) {
  return r.elem_size != 0 && r.numel <= kMaxApplyBytes / r.elem_size;
}

// What applying `r` (new values, or old ones with `undo`) must do: write the
// value of every entry whose position is in range. The caller applies it
// only when every position is.
void ReferenceScatter(const JournalRecord& r, bool undo, uint8_t* target) {
  const uint8_t* values = undo ? r.old_values : r.new_values;
  for (uint64_t i = 0; i < r.count; ++i) {
    const uint64_t p = r.position(i);
    if (p < r.numel) std::memcpy(target + p * r.elem_size, values + i * r.elem_size, r.elem_size);
  }
}

void Fill(uint8_t* bytes, size_t size, uint64_t seed) {
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(i * 131 + seed);
}

// One record on its own: CheckFits, Apply and ApplyAndVisit against the
// reference, in both directions.
void ExerciseRecord(const JournalRecord& r) {
  if (!Small(r)) return;
  const size_t bytes = r.numel * r.elem_size;
  const Status fits = r.CheckFits(bytes);
  Require(fits.ok() || fits.IsCorruption(), "CheckFits reports Corruption");
  // A buffer of another size never fits.
  Require(!r.CheckFits(bytes + 1).ok(), "CheckFits refuses a buffer of another size");
  for (bool undo : {false, true}) {
    std::unique_ptr<uint8_t[]> target(new uint8_t[bytes + 1]);
    std::vector<uint8_t> expected(bytes);
    Fill(target.get(), bytes, undo);
    Fill(expected.data(), bytes, undo);
    const Status applied = r.Apply({target.get(), bytes}, undo);
    const bool allowed = fits.ok() && (undo || !r.undo_only);
    Require(applied.ok() == allowed, "Apply accepts exactly the records that fit");
    Require(applied.ok() || applied.IsCorruption(), "Apply reports Corruption");
    if (allowed) ReferenceScatter(r, undo, expected.data());
    Require(bytes == 0 || std::memcmp(target.get(), expected.data(), bytes) == 0,
            "Apply writes exactly the record's values (nothing when it fails)");
  }
}

// The records of one tensor, as recovery groups them, through
// ApplyRecordsAndVisit: the result must be each record applied in file order
// (reverse order with `undo`), and the pieces must tile the target in order,
// each already final when handed over.
void ExerciseGroup(const std::vector<const JournalRecord*>& group, size_t piece_bytes) {
  const JournalRecord& first = *group[0];
  if (!Small(first)) return;
  const size_t bytes = first.numel * first.elem_size;
  for (bool undo : {false, true}) {
    bool allowed = true;
    for (const JournalRecord* r : group) {
      allowed = allowed && r->CheckFits(bytes).ok() && (undo || !r->undo_only);
    }
    std::vector<uint8_t> expected(bytes);
    Fill(expected.data(), bytes, 7);
    if (allowed) {
      for (size_t k = 0; k < group.size(); ++k) {
        ReferenceScatter(*group[undo ? group.size() - 1 - k : k], undo, expected.data());
      }
    }
    std::unique_ptr<uint8_t[]> target(new uint8_t[bytes + 1]);
    Fill(target.get(), bytes, 7);
    size_t visited = 0;
    bool in_order = true;
    auto visit = [&](std::span<const uint8_t> piece) {
      in_order = in_order && piece.data() == target.get() + visited && !piece.empty() &&
                 visited + piece.size() <= bytes &&
                 std::memcmp(piece.data(), expected.data() + visited, piece.size()) == 0;
      visited += piece.size();
    };
    const Status status = deltasync::store_internal::ApplyRecordsAndVisit(
        group, {target.get(), bytes}, undo, piece_bytes, visit);
    Require(status.ok() == allowed, "ApplyRecordsAndVisit accepts exactly what fits");
    if (!status.ok()) {
      Require(status.IsCorruption(), "ApplyRecordsAndVisit reports Corruption");
      continue;
    }
    Require(in_order, "pieces are handed over in order, each with its final bytes");
    Require(visited == bytes, "the pieces cover the target");
    Require(bytes == 0 || std::memcmp(target.get(), expected.data(), bytes) == 0,
            "grouped apply equals the records applied one after another");
  }
}

void ExerciseRecords(const Journal& journal, size_t piece_bytes) {
  std::map<std::string_view, std::vector<const JournalRecord*>> groups;
  for (const JournalRecord& r : journal.records()) {
    ExerciseRecord(r);
    groups[r.name].push_back(&r);
  }
  for (const auto& entry : groups) {
    const std::vector<const JournalRecord*>& group = entry.second;
    // Recovery refuses groups whose records disagree on the tensor's size.
    const bool same = std::all_of(group.begin(), group.end(), [&](const JournalRecord* r) {
      return r->numel == group[0]->numel && r->elem_size == group[0]->elem_size;
    });
    if (same) ExerciseGroup(group, piece_bytes);
  }
}

bool SameRecord(const JournalRecord& a, const JournalRecord& b) {
  if (a.name != b.name || a.numel != b.numel || a.elem_size != b.elem_size ||
      a.checksum != b.checksum || a.base_checksum != b.base_checksum || a.count != b.count ||
      a.undo_only != b.undo_only) {
    return false;
  }
  for (uint64_t i = 0; i < a.count; ++i) {
    if (a.position(i) != b.position(i)) return false;
  }
  const size_t values = a.count * a.elem_size;
  if (values == 0) return true;
  if (std::memcmp(a.old_values, b.old_values, values) != 0) return false;
  return a.undo_only || std::memcmp(a.new_values, b.new_values, values) == 0;
}

void FuzzRaw(std::span<const uint8_t> file, size_t piece_bytes) {
  const std::string& path = JournalPath();
  deltasync::fuzz_util::WriteFile(
      path, std::string_view(reinterpret_cast<const char*>(file.data()), file.size()));
  Result<std::unique_ptr<Journal>> full = Journal::Open(path);
  Result<std::unique_ptr<Journal>> prefix = Journal::OpenIntactPrefix(path);
  Require(full.ok() || full.status().IsCorruption(), "Open reports Corruption");
  if (!prefix.ok()) {
    Require(prefix.status().IsCorruption(), "OpenIntactPrefix reports Corruption");
    Require(!full.ok(), "what Open accepts, OpenIntactPrefix accepts");
    return;
  }
  Require(full.ok() == (*prefix)->complete(), "complete exactly when Open accepts it");
  if (full.ok()) {
    Require((*full)->version() == (*prefix)->version() &&
                (*full)->from_version() == (*prefix)->from_version() &&
                (*full)->records().size() == (*prefix)->records().size(),
            "Open and OpenIntactPrefix read the same journal");
    for (size_t i = 0; i < (*full)->records().size(); ++i) {
      Require(SameRecord((*full)->records()[i], (*prefix)->records()[i]),
              "Open and OpenIntactPrefix read the same records");
    }
  }
  if ((*prefix)->records().size() > 1) {
    Result<std::unique_ptr<Journal>> pooled = Journal::OpenIntactPrefix(path, &Pool());
    Require(pooled.ok() && (*pooled)->records().size() == (*prefix)->records().size() &&
                (*pooled)->complete() == (*prefix)->complete(),
            "checking records on a pool gives the same prefix");
  }
  ExerciseRecords(**prefix, piece_bytes);
}

struct WrittenRecord {
  std::string name, checksum, base_checksum;
  uint64_t numel = 0;
  uint32_t elem_size = 1;
  bool undo_only = false;
  ChangeSet changes;
  uint64_t end = 0;  // file offset just past the record
};

void FuzzWritten(InputReader& in, size_t piece_bytes) {
  const std::string& path = JournalPath();
  const int64_t version = 1 + in.Next();
  const int64_t from_version = in.Next();
  const int records = 1 + in.Next() % 6;
  std::vector<WrittenRecord> written(static_cast<size_t>(records));
  uint64_t seed = in.Next32();
  for (WrittenRecord& w : written) {
    const uint8_t shape = in.Next();
    w.elem_size = 1u << (shape & 3);
    w.undo_only = shape & 4;
    w.changes.wide = shape & 8;
    // Names shared between records make groups of several records.
    w.name = "t" + std::to_string((shape >> 4) % 3);
    w.checksum = (shape & 0x40) ? "xxh3-64:" + std::to_string(in.Next32()) : "";
    w.base_checksum = (shape & 0x80) ? "blake3:" + std::string(in.Next() % 70, 'a') : "";
    w.numel = 1 + in.Next16() % 2000;
    w.changes.numel = w.numel;
    w.changes.elem_size = w.elem_size;
    // Ascending positions, sometimes with gaps too wide to be gap-coded.
    // The reader refuses a record with more changes than elements.
    const uint64_t count = std::min<uint64_t>(in.Next() % 64, w.numel);
    const uint64_t wide_gap = in.Next() & 1 ? 70000 : 0;
    uint64_t pos = in.Next() % 8;
    for (uint64_t i = 0; i < count; ++i) {
      if (w.changes.wide) {
        w.changes.pos64.push_back(pos);
      } else {
        w.changes.pos32.push_back(static_cast<uint32_t>(pos));
      }
      pos += 1 + in.Next() % 40 + (i == count / 2 ? wide_gap : 0);
    }
    const size_t values = w.changes.count() * w.elem_size;
    for (size_t i = 0; i < values; ++i) {
      w.changes.old_values.push_back(static_cast<uint8_t>(deltasync::fuzz_util::SplitMix(seed)));
      w.changes.new_values.push_back(static_cast<uint8_t>(deltasync::fuzz_util::SplitMix(seed)));
    }
    if (w.undo_only) w.changes.new_values.clear();
  }
  const bool finish = in.Next() & 1;
  const uint32_t cut_choice = in.Next32();
  const bool cut = in.Next() & 1;
  const int flips = in.Next() % 4;
  uint32_t flip_at[4], flip_with[4];
  for (int f = 0; f < flips; ++f) {
    flip_at[f] = in.Next32();
    flip_with[f] = in.Next() | 1;  // never a no-op
  }

  {
    Result<std::unique_ptr<JournalWriter>> writer =
        JournalWriter::Create(path, version, from_version);
    Require(writer.ok(), "JournalWriter::Create");
    std::vector<uint8_t> head;
    for (WrittenRecord& w : written) {
      Require((*writer)
                  ->AppendRecord(w.name, w.numel, w.elem_size, w.checksum, w.base_checksum,
                                 w.changes, &head, w.undo_only)
                  .ok(),
              "AppendRecord");
      w.end = std::filesystem::file_size(path);
    }
    if (finish) Require((*writer)->Finish(/*durable=*/false).ok(), "JournalWriter::Finish");
  }
  const std::string original = deltasync::fuzz_util::ReadFile(path);
  std::string bytes = original;
  if (cut) bytes.resize(cut_choice % (bytes.size() + 1));
  for (int f = 0; f < flips && !bytes.empty(); ++f) {
    const size_t at = flip_at[f] % bytes.size();
    bytes[at] = static_cast<char>(bytes[at] ^ flip_with[f]);
  }
  // The first byte that differs from what was written (two flips of one
  // byte may cancel out), or the size.
  size_t intact = 0;
  while (intact < bytes.size() && bytes[intact] == original[intact]) ++intact;
  const bool damaged = bytes != original;
  deltasync::fuzz_util::WriteFile(path, bytes);

  Result<std::unique_ptr<Journal>> prefix = Journal::OpenIntactPrefix(path);
  Result<std::unique_ptr<Journal>> full = Journal::Open(path);
  if (intact < 32) {
    Require(!prefix.ok() && prefix.status().IsCorruption(), "a damaged header is refused");
    Require(!full.ok(), "a damaged header is refused by Open");
    return;
  }
  Require(prefix.ok(), "a journal with an intact header opens as its intact prefix");
  const Journal& j = **prefix;
  Require(j.version() == version && j.from_version() == from_version, "header versions");
  size_t expected = 0;
  while (expected < written.size() && written[expected].end <= intact) ++expected;
  Require(j.records().size() == expected,
          "the intact prefix is exactly the records before the first damaged byte");
  for (size_t i = 0; i < expected; ++i) {
    const WrittenRecord& w = written[i];
    const JournalRecord& r = j.records()[i];
    bool same = r.name == w.name && r.numel == w.numel && r.elem_size == w.elem_size &&
                r.checksum == w.checksum && r.base_checksum == w.base_checksum &&
                r.count == w.changes.count() && r.undo_only == w.undo_only;
    for (uint64_t k = 0; same && k < r.count; ++k) same = r.position(k) == w.changes.position(k);
    const size_t values = w.changes.count() * w.elem_size;
    same = same &&
           (values == 0 || std::memcmp(r.old_values, w.changes.old_values.data(), values) == 0);
    same = same && (w.undo_only || values == 0 ||
                    std::memcmp(r.new_values, w.changes.new_values.data(), values) == 0);
    Require(same, "each intact record reads back as written");
  }
  Require(j.complete() == (finish && !damaged), "complete only when finished and undamaged");
  Require(full.ok() == j.complete(), "Open accepts exactly the complete journals");
  ExerciseRecords(j, piece_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  InputReader in(data, size);
  const uint8_t control = in.Next();
  const size_t piece_bytes = 1 + (control >> 1) % 100;
  if (control & 1) {
    FuzzWritten(in, piece_bytes);
  } else {
    FuzzRaw(in.Rest(), piece_bytes);
  }
  return 0;
}
