// The apply journal: every change of one version, decoded into idempotent
// (position, old value, new value) triples, written before the local
// checkpoint is touched. Replaying it (new values) or rolling it back (old
// values) any number of times gives the same bytes, whatever the encoding
// it came from: this is what makes an interrupted xor apply recoverable.
//
// Layout (docs/format.md, "Delta store", "Apply journal"): a 32-byte header,
// records back to back, a 32-byte trailer. The trailer is written only once
// every record is. Records are appended one at a time, so a journal cut
// short (a killed process) is a run of intact records, at most one torn
// record after them, and no trailer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync::store_internal {

inline constexpr const char* kJournalFileName = "journal";

// One tensor's change, as stored (views into the journal's bytes).
struct JournalRecord {
  std::string_view name;
  uint64_t numel = 0;
  uint32_t elem_size = 0;
  uint32_t position_width = 4;     // 4 or 8 bytes
  std::string_view checksum;       // "algo:hex" of the new bytes
  std::string_view base_checksum;  // "algo:hex" of the old bytes, or empty
  uint64_t count = 0;
  const uint8_t* positions = nullptr;   // element indices, little-endian
  const uint8_t* old_values = nullptr;  // count * elem_size
  const uint8_t* new_values = nullptr;  // null in an undo-only record
  bool undo_only = false;               // old values only: cannot be replayed

  uint64_t position(uint64_t i) const;
  // Writes the new (or, with `undo`, the old) value of every entry into
  // `target`, which must be the tensor's numel * elem_size bytes. Checks
  // every position before writing anything (Corruption otherwise, also for
  // a replay of an undo-only record).
  Status Apply(std::span<uint8_t> target, bool undo) const;
  // Corruption unless the record covers target_bytes and every position is
  // in range.
  Status CheckFits(size_t target_bytes) const;
  // Apply, handing `visit` consecutive pieces of `target` (piece_bytes
  // each, rounded down to whole elements; the last may be shorter) in
  // order, each once its changes are written. With ascending positions (as
  // every record we write has) the two are interleaved, so a caller that
  // hashes the pieces reads each while it is still in cache; otherwise
  // every change is written first.
  Status ApplyAndVisit(std::span<uint8_t> target, bool undo, size_t piece_bytes,
                       const std::function<void(std::span<const uint8_t>)>& visit) const;
};

// ApplyAndVisit for the records of one tensor, in journal order: a large
// tensor's changes are journaled as several records, each a run of
// ascending positions past the previous record's. Records that do not
// follow that shape are applied whole, one after another (in reverse with
// `undo`), before the pieces are visited.
Status ApplyRecordsAndVisit(std::span<const JournalRecord* const> records,
                            std::span<uint8_t> target, bool undo, size_t piece_bytes,
                            const std::function<void(std::span<const uint8_t>)>& visit);

// Writes a journal; records may be appended from many threads at once. They
// are written one after another, each once its bytes are ready, so that the
// file is always a prefix of whole records plus at most one being written.
// After a failed append every later one fails too.
class JournalWriter {
 public:
  static Result<std::unique_ptr<JournalWriter>> Create(const std::string& path, int64_t version,
                                                       int64_t from_version);
  ~JournalWriter();
  JournalWriter(const JournalWriter&) = delete;
  JournalWriter& operator=(const JournalWriter&) = delete;

  // Appends one sealed record of `changes` (positions, old and new values,
  // which it must hold) for tensor `name`. The arrays go to the file
  // straight from `changes`; only the record's head is built, in *head
  // (contents replaced, capacity kept for reuse). With `undo_only` the
  // record keeps no new values (it can be rolled back, not replayed) and,
  // when every gap between its ascending positions fits in 2 bytes, stores
  // the positions as those gaps: 4 bytes a BF16 change instead of 8.
  Status AppendRecord(std::string_view name, uint64_t numel, uint32_t elem_size,
                      std::string_view checksum, std::string_view base_checksum,
                      const ChangeSet& changes, std::vector<uint8_t>* head, bool undo_only = false);
  // Writes the trailer; with `durable`, fsyncs the file and its directory.
  Status Finish(bool durable);

 private:
  JournalWriter() = default;
  std::string path_;
  int fd_ = -1;
  uint8_t header_[32] = {};
  std::mutex mu_;  // guards the three below
  uint64_t next_offset_ = 0;
  uint64_t records_ = 0;
  bool failed_ = false;
};

// A complete journal, mapped read-only and validated.
class Journal {
 public:
  // Corruption (saying why) when the file is not a complete journal;
  // NotFound when there is none. With `pool`, the records' checksums are
  // verified in parallel on it.
  static Result<std::unique_ptr<Journal>> Open(const std::string& path, ThreadPool* pool = nullptr);
  // Like Open, but a journal cut short is not an error: its records are
  // those before the first that is torn or damaged, and complete() is
  // false. Corruption only when the header itself is bad.
  static Result<std::unique_ptr<Journal>> OpenIntactPrefix(const std::string& path,
                                                           ThreadPool* pool = nullptr);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  int64_t version() const { return version_; }
  int64_t from_version() const { return from_version_; }
  const std::vector<JournalRecord>& records() const { return records_; }
  // Whether the trailer was found: every record of the journal is here.
  bool complete() const { return complete_; }

 private:
  Journal() = default;
  static Result<std::unique_ptr<Journal>> OpenImpl(const std::string& path, ThreadPool* pool,
                                                   bool allow_incomplete);
  bool complete_ = false;
  // Gap-coded positions, expanded (JournalRecord::positions points here).
  std::vector<std::vector<uint64_t>> expanded_;
  void* map_ = nullptr;
  size_t size_ = 0;
  int64_t version_ = 0;
  int64_t from_version_ = 0;
  std::vector<JournalRecord> records_;
};

}  // namespace deltasync::store_internal
