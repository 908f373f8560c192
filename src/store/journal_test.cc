// JournalRecord::ApplyAndVisit: pieces are handed over in order, each only
// once its changes are written (and, for ascending positions, before the
// next piece's are), and bad records change nothing.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "store/journal.h"

namespace deltasync::store_internal {
namespace {

// A record over a tensor of `numel` 2-byte elements whose element i holds i.
struct Record {
  std::vector<uint8_t> positions, old_values, new_values;
  JournalRecord record;

  Record(uint64_t numel, const std::vector<uint32_t>& where) {
    for (uint32_t p : where) {
      for (int b = 0; b < 4; ++b) positions.push_back(static_cast<uint8_t>(p >> (8 * b)));
      const uint16_t old_value = static_cast<uint16_t>(p), new_value = static_cast<uint16_t>(~p);
      old_values.insert(old_values.end(),
                        {static_cast<uint8_t>(old_value), static_cast<uint8_t>(old_value >> 8)});
      new_values.insert(new_values.end(),
                        {static_cast<uint8_t>(new_value), static_cast<uint8_t>(new_value >> 8)});
    }
    record.name = "t";
    record.numel = numel;
    record.elem_size = 2;
    record.position_width = 4;
    record.count = where.size();
    record.positions = positions.data();
    record.old_values = old_values.data();
    record.new_values = new_values.data();
  }
};

std::vector<uint8_t> Tensor(uint64_t numel) {
  std::vector<uint8_t> t(numel * 2);
  for (uint64_t i = 0; i < numel; ++i) {
    const uint16_t v = static_cast<uint16_t>(i);
    std::memcpy(&t[2 * i], &v, 2);
  }
  return t;
}

uint16_t At(const std::vector<uint8_t>& t, size_t i) {
  uint16_t v;
  std::memcpy(&v, &t[2 * i], 2);
  return v;
}

TEST(JournalRecordApplyAndVisit, AscendingPiecesArriveWrittenAndInOrder) {
  const uint64_t numel = 1001;  // the last piece is short
  const std::vector<uint32_t> where = {0, 31, 32, 33, 500, 511, 512, 999, 1000};
  Record r(numel, where);
  std::vector<uint8_t> target = Tensor(numel);
  size_t next_offset = 0;
  // 70 bytes rounds down to 35 elements.
  Status s = r.record.ApplyAndVisit(target, false, 70, [&](std::span<const uint8_t> piece) {
    const size_t offset = static_cast<size_t>(piece.data() - target.data());
    EXPECT_EQ(offset, next_offset);
    EXPECT_EQ(piece.size(), std::min<size_t>(70, target.size() - offset));
    next_offset = offset + piece.size();
    for (uint32_t p : where) {
      const bool written = At(target, p) == static_cast<uint16_t>(~p);
      // Changes of this piece and earlier ones are in; later ones are not.
      EXPECT_EQ(written, 2 * p < next_offset) << "position " << p << " at piece " << offset;
    }
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(next_offset, target.size());
  std::vector<uint8_t> expected = Tensor(numel);
  for (uint32_t p : where) {
    const uint16_t v = static_cast<uint16_t>(~p);
    std::memcpy(&expected[2 * p], &v, 2);
  }
  EXPECT_EQ(target, expected);

  // Undo restores every old value.
  ASSERT_TRUE(r.record.ApplyAndVisit(target, true, 64, [](std::span<const uint8_t>) {}).ok());
  EXPECT_EQ(target, Tensor(numel));
}

TEST(JournalRecordApplyAndVisit, UnorderedPositionsAreAllWrittenBeforeTheFirstPiece) {
  const uint64_t numel = 100;
  const std::vector<uint32_t> where = {90, 3, 50};
  Record r(numel, where);
  std::vector<uint8_t> target = Tensor(numel);
  size_t pieces = 0;
  ASSERT_TRUE(r.record
                  .ApplyAndVisit(target, false, 32,
                                 [&](std::span<const uint8_t>) {
                                   ++pieces;
                                   for (uint32_t p : where) {
                                     EXPECT_EQ(At(target, p), static_cast<uint16_t>(~p));
                                   }
                                 })
                  .ok());
  EXPECT_EQ(pieces, (2 * numel + 31) / 32);
}

TEST(JournalRecordApplyAndVisit, BadRecordsChangeNothingAndVisitNothing) {
  const uint64_t numel = 100;
  for (const std::vector<uint32_t>& where :
       {std::vector<uint32_t>{1, 2, 100}, std::vector<uint32_t>{100, 1}}) {
    Record r(numel, where);
    std::vector<uint8_t> target = Tensor(numel);
    size_t pieces = 0;
    Status s =
        r.record.ApplyAndVisit(target, false, 32, [&](std::span<const uint8_t>) { ++pieces; });
    EXPECT_TRUE(s.IsCorruption()) << s.ToString();
    EXPECT_NE(s.message().find("out of range"), std::string::npos) << s.ToString();
    EXPECT_EQ(pieces, 0u);
    EXPECT_EQ(target, Tensor(numel));
  }
  Record r(numel, {1});
  std::vector<uint8_t> shorter = Tensor(numel - 1);
  Status s = r.record.ApplyAndVisit(shorter, false, 32, [](std::span<const uint8_t>) {});
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_EQ(shorter, Tensor(numel - 1));
}

// A tensor journaled as several records, each a run of positions past the
// one before: pieces still arrive in order, each with exactly the changes
// of all records up to its end.
TEST(JournalApplyRecordsAndVisit, ConsecutiveRecordsStreamAcrossRecordBoundaries) {
  const uint64_t numel = 1001;
  const std::vector<std::vector<uint32_t>> parts = {
      {0, 31}, {32, 33, 500}, {}, {511, 512}, {999, 1000}};
  std::vector<std::unique_ptr<Record>> owned;
  std::vector<const JournalRecord*> records;
  std::vector<uint32_t> where;
  for (const auto& part : parts) {
    owned.push_back(std::make_unique<Record>(numel, part));
    records.push_back(&owned.back()->record);
    where.insert(where.end(), part.begin(), part.end());
  }
  std::vector<uint8_t> target = Tensor(numel);
  size_t next_offset = 0;
  Status s = ApplyRecordsAndVisit(records, target, false, 70, [&](std::span<const uint8_t> piece) {
    const size_t offset = static_cast<size_t>(piece.data() - target.data());
    EXPECT_EQ(offset, next_offset);
    next_offset = offset + piece.size();
    for (uint32_t p : where) {
      EXPECT_EQ(At(target, p) == static_cast<uint16_t>(~p), 2 * p < next_offset)
          << "position " << p << " at piece " << offset;
    }
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(next_offset, target.size());
  ASSERT_TRUE(
      ApplyRecordsAndVisit(records, target, true, 64, [](std::span<const uint8_t>) {}).ok());
  EXPECT_EQ(target, Tensor(numel));
}

// Records that overlap (not written by us) are applied whole and in order,
// so the later one wins; undo goes in reverse, back to the first's old values.
TEST(JournalApplyRecordsAndVisit, OverlappingRecordsApplyInOrderAndUndoInReverse) {
  const uint64_t numel = 100;
  Record first(numel, {10, 20});
  Record second(numel, {20, 30});
  // The second record's value at 20 differs from the first's.
  second.new_values[0] = 0xAB;
  second.new_values[1] = 0xCD;
  second.old_values[0] = static_cast<uint8_t>(~20);
  second.old_values[1] = static_cast<uint8_t>(~20 >> 8);
  const std::vector<const JournalRecord*> records = {&first.record, &second.record};
  std::vector<uint8_t> target = Tensor(numel);
  size_t pieces = 0;
  ASSERT_TRUE(ApplyRecordsAndVisit(records, target, false, 32, [&](std::span<const uint8_t>) {
                ++pieces;
                EXPECT_EQ(At(target, 30), static_cast<uint16_t>(~30));  // all written first
              }).ok());
  EXPECT_EQ(pieces, (2 * numel + 31) / 32);
  EXPECT_EQ(At(target, 10), static_cast<uint16_t>(~10));
  EXPECT_EQ(At(target, 20), 0xCDAB);
  ASSERT_TRUE(
      ApplyRecordsAndVisit(records, target, true, 32, [](std::span<const uint8_t>) {}).ok());
  EXPECT_EQ(target, Tensor(numel));
}

TEST(JournalApplyRecordsAndVisit, AnOutOfRangeRecordChangesNothing) {
  const uint64_t numel = 100;
  Record good(numel, {1, 2});
  Record bad(numel, {50, 100});
  const std::vector<const JournalRecord*> records = {&good.record, &bad.record};
  std::vector<uint8_t> target = Tensor(numel);
  size_t pieces = 0;
  Status s =
      ApplyRecordsAndVisit(records, target, false, 32, [&](std::span<const uint8_t>) { ++pieces; });
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_EQ(pieces, 0u);
  EXPECT_EQ(target, Tensor(numel));
}

}  // namespace
}  // namespace deltasync::store_internal

namespace deltasync::store_internal {
namespace {

// A journal path in a directory of its own, removed with it.
struct TempJournal {
  std::string dir;
  std::string path;
  explicit TempJournal(const std::string& tag)
      : dir(::testing::TempDir() + "/journal_" + tag + "_" + std::to_string(::getpid())),
        path(dir + "/journal") {
    std::filesystem::create_directories(dir);
  }
  ~TempJournal() { std::filesystem::remove_all(dir); }
};

// Records go to the file straight from the ChangeSet's arrays (no record
// buffer): what Journal::Open reads back must be exactly what was appended,
// for narrow and wide positions and for lengths that need padding.
TEST(JournalWriterTest, RecordsReadBackExactlyAsAppended) {
  const TempJournal temp("writer");
  const std::string& path = temp.path;
  Result<std::unique_ptr<JournalWriter>> writer = JournalWriter::Create(path, 7, 6);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  std::vector<ChangeSet> sets;
  for (bool wide : {false, true}) {
    for (uint32_t es : {1u, 2u, 8u}) {
      ChangeSet c;
      c.numel = 1000;
      c.elem_size = es;
      c.wide = wide;
      for (uint64_t k = 0; k < 3 + es; ++k) {  // odd sizes: padded to 8
        const uint64_t pos = 17 * k + es;
        if (wide)
          c.pos64.push_back(pos);
        else
          c.pos32.push_back(static_cast<uint32_t>(pos));
        for (uint32_t b = 0; b < es; ++b) {
          c.old_values.push_back(static_cast<uint8_t>(k + b));
          c.new_values.push_back(static_cast<uint8_t>(~(k + b)));
        }
      }
      sets.push_back(std::move(c));
    }
  }
  std::vector<uint8_t> head;
  for (size_t i = 0; i < sets.size(); ++i) {
    Status s =
        (*writer)->AppendRecord("tensor." + std::to_string(i), sets[i].numel, sets[i].elem_size,
                                "xxh3-128:00ff", i % 2 ? "" : "xxh3-128:ab", sets[i], &head);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  // A change list without old values is refused and adds nothing.
  ChangeSet bad = sets[0];
  bad.old_values.clear();
  const Status refused =
      (*writer)->AppendRecord("bad", bad.numel, bad.elem_size, "xxh3-128:00", "", bad, &head);
  EXPECT_EQ(refused.code(), StatusCode::kInternal) << refused.ToString();
  ASSERT_TRUE((*writer)->Finish(false).ok());
  writer->reset();

  Result<std::unique_ptr<Journal>> journal = Journal::Open(path);
  ASSERT_TRUE(journal.ok()) << journal.status().ToString();
  const std::vector<JournalRecord>& records = (*journal)->records();
  ASSERT_EQ(records.size(), sets.size());
  for (size_t i = 0; i < sets.size(); ++i) {
    SCOPED_TRACE(i);
    const JournalRecord& r = records[i];
    const ChangeSet& c = sets[i];
    EXPECT_EQ(r.name, "tensor." + std::to_string(i));
    EXPECT_EQ(r.checksum, "xxh3-128:00ff");
    EXPECT_EQ(r.base_checksum, i % 2 ? "" : "xxh3-128:ab");
    EXPECT_EQ(r.numel, c.numel);
    EXPECT_EQ(r.elem_size, c.elem_size);
    EXPECT_EQ(r.position_width, c.wide ? 8u : 4u);
    ASSERT_EQ(r.count, c.count());
    for (uint64_t k = 0; k < r.count; ++k) EXPECT_EQ(r.position(k), c.position(k));
    EXPECT_EQ(0, std::memcmp(r.old_values, c.old_values.data(), c.old_values.size()));
    EXPECT_EQ(0, std::memcmp(r.new_values, c.new_values.data(), c.new_values.size()));
  }
  journal->reset();
}

// A damaged record makes the whole journal incomplete, whether its
// records are verified on one thread or on a pool.
TEST(JournalWriterTest, ADamagedRecordMakesTheJournalIncomplete) {
  const TempJournal temp("damage");
  const std::string& path = temp.path;
  {
    Result<std::unique_ptr<JournalWriter>> writer = JournalWriter::Create(path, 2, 1);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    std::vector<uint8_t> head;
    for (int i = 0; i < 40; ++i) {
      ChangeSet c;
      c.numel = 100;
      c.elem_size = 2;
      for (uint32_t k = 0; k < 10; ++k) {
        c.pos32.push_back(k * 7);
        c.old_values.insert(c.old_values.end(), {static_cast<uint8_t>(k), 0});
        c.new_values.insert(c.new_values.end(), {static_cast<uint8_t>(k + i), 1});
      }
      const std::string name = "tensor." + std::to_string(i);
      ASSERT_TRUE((*writer)->AppendRecord(name, 100, 2, "xxh3-64:00", "", c, &head).ok());
    }
    ASSERT_TRUE((*writer)->Finish(false).ok());
  }
  ThreadPool pool(2);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    Result<std::unique_ptr<Journal>> intact = Journal::Open(path, p);
    ASSERT_TRUE(intact.ok()) << intact.status().ToString();
    EXPECT_EQ((*intact)->records().size(), 40u);
  }
  // A byte of record 13's new values ({k + 13, 1} for k = 7, 8, 9: the
  // first record holding this run).
  std::vector<uint8_t> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const uint8_t needle[] = {20, 1, 21, 1, 22, 1};
  auto found = std::search(bytes.begin(), bytes.end(), std::begin(needle), std::end(needle));
  ASSERT_NE(found, bytes.end());
  found[2] ^= 0x10;
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    Result<std::unique_ptr<Journal>> damaged = Journal::Open(path, p);
    ASSERT_FALSE(damaged.ok());
    EXPECT_TRUE(damaged.status().IsCorruption()) << damaged.status().ToString();
    EXPECT_NE(damaged.status().message().find("record checksum mismatch"), std::string::npos)
        << damaged.status().ToString();
    // Read as a journal cut short, it is the records before the damage.
    Result<std::unique_ptr<Journal>> prefix = Journal::OpenIntactPrefix(path, p);
    ASSERT_TRUE(prefix.ok()) << prefix.status().ToString();
    EXPECT_FALSE((*prefix)->complete());
    EXPECT_EQ((*prefix)->records().size(), 13u);
  }
}

// A journal cut at any byte (a killed append) reads back as exactly the
// records wholly before the cut; only the whole file is complete.
TEST(JournalWriterTest, ACutShortJournalIsItsWholeRecords) {
  const TempJournal temp("cut");
  const std::string& path = temp.path;
  std::vector<size_t> ends;  // file size after each record
  {
    Result<std::unique_ptr<JournalWriter>> writer = JournalWriter::Create(path, 7, 6);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    std::vector<uint8_t> head;
    for (uint32_t i = 0; i < 5; ++i) {
      ChangeSet c;
      c.numel = 1000;
      c.elem_size = 4;
      for (uint32_t k = 0; k < 3 * i; ++k) {
        c.pos32.push_back(k * 11 + i);
        for (int b = 0; b < 4; ++b) {
          c.old_values.push_back(static_cast<uint8_t>(k + b));
          c.new_values.push_back(static_cast<uint8_t>(k * b + i));
        }
      }
      ASSERT_TRUE((*writer)
                      ->AppendRecord("t" + std::to_string(i), 1000, 4, "xxh3-64:0a", "", c, &head)
                      .ok());
      ends.push_back(std::filesystem::file_size(path));
    }
    ASSERT_TRUE((*writer)->Finish(false).ok());
  }
  std::string whole;
  {
    std::ifstream in(path, std::ios::binary);
    whole.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_EQ(whole.size(), ends.back() + 32);
  for (size_t cut = 0; cut <= whole.size(); ++cut) {
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(whole.data(), static_cast<std::streamsize>(cut));
    }
    Result<std::unique_ptr<Journal>> prefix = Journal::OpenIntactPrefix(path);
    if (cut < 32) {
      EXPECT_TRUE(prefix.status().IsCorruption()) << cut;
      continue;
    }
    ASSERT_TRUE(prefix.ok()) << cut << ": " << prefix.status().ToString();
    const size_t whole_records =
        static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), cut) - ends.begin());
    ASSERT_EQ((*prefix)->records().size(), whole_records) << cut;
    EXPECT_EQ((*prefix)->version(), 7);
    EXPECT_EQ((*prefix)->from_version(), 6);
    EXPECT_EQ((*prefix)->complete(), cut == whole.size()) << cut;
    EXPECT_EQ(Journal::Open(path).ok(), cut == whole.size()) << cut;
    for (size_t i = 0; i < whole_records; ++i) {
      const JournalRecord& r = (*prefix)->records()[i];
      EXPECT_EQ(r.name, "t" + std::to_string(i));
      ASSERT_EQ(r.count, 3 * i);
      if (r.count > 0) {
        EXPECT_EQ(r.position(r.count - 1), (r.count - 1) * 11 + i);
      }
    }
  }
}

// After an append fails, the record may be torn: no later record may land
// after it, or recovery could not find it.
TEST(JournalWriterTest, NothingIsAppendedAfterAFailedAppend) {
  const TempJournal temp("fail");
  Result<std::unique_ptr<JournalWriter>> writer = JournalWriter::Create(temp.path, 2, 1);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  auto changes = [](uint32_t n) {
    ChangeSet c;
    c.numel = 1u << 20;
    c.elem_size = 1;
    for (uint32_t k = 0; k < n; ++k) c.pos32.push_back(k);
    c.old_values.assign(n, 1);
    c.new_values.assign(n, 2);
    return c;
  };
  std::vector<uint8_t> head;
  ASSERT_TRUE((*writer)->AppendRecord("small", 1u << 20, 1, "", "", changes(4), &head).ok());
  // The file may not grow past 64 KiB: a 600 KB record fails part way.
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old_limit;
  limit.rlim_cur = 64 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  const Status big = (*writer)->AppendRecord("big", 1u << 20, 1, "", "", changes(100000), &head);
  const Status after = (*writer)->AppendRecord("small", 1u << 20, 1, "", "", changes(4), &head);
  const Status finish = (*writer)->Finish(false);
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_FALSE(big.ok());
  EXPECT_FALSE(after.ok());
  EXPECT_NE(after.message().find("an earlier journal append failed"), std::string::npos)
      << after.ToString();
  EXPECT_FALSE(finish.ok());
  Result<std::unique_ptr<Journal>> prefix = Journal::OpenIntactPrefix(temp.path);
  ASSERT_TRUE(prefix.ok()) << prefix.status().ToString();
  EXPECT_FALSE((*prefix)->complete());
  ASSERT_EQ((*prefix)->records().size(), 1u);
  EXPECT_EQ((*prefix)->records()[0].name, "small");
}

// Undo-only records (a streamed apply's): old values only, positions
// gap-coded when every gap fits in 2 bytes. They read back exactly, roll
// back, and refuse to be replayed.
TEST(JournalWriterTest, UndoOnlyRecordsRollBackAndRefuseReplay) {
  const TempJournal temp("undo");
  constexpr uint64_t numel = 200000;
  auto changes = [](const std::vector<uint32_t>& positions) {
    ChangeSet c;
    c.numel = numel;
    c.elem_size = 2;
    c.pos32 = positions;
    for (uint32_t p : positions) {
      c.old_values.insert(c.old_values.end(), {static_cast<uint8_t>(p), 0x0a});
      c.new_values.insert(c.new_values.end(), {static_cast<uint8_t>(p), 0x0b});
    }
    return c;
  };
  const std::vector<uint32_t> far = {3, 10, 10 + 65536};  // a gap too wide: absolute positions
  std::vector<uint32_t> near;                             // gap-coded, the widest gap fitting
  for (uint32_t p = 5; p < 15; ++p) near.push_back(p);
  near.push_back(14 + 65535);
  const std::vector<std::vector<uint32_t>> sets = {far, near, {}};
  {
    Result<std::unique_ptr<JournalWriter>> writer = JournalWriter::Create(temp.path, 3, 2);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    std::vector<uint8_t> head;
    for (size_t i = 0; i < sets.size(); ++i) {
      ChangeSet c = changes(sets[i]);
      c.new_values.clear();  // not needed, not written
      ASSERT_TRUE((*writer)
                      ->AppendRecord(std::string(1, static_cast<char>('a' + i)), numel, 2, "x:0",
                                     "", c, &head, /*undo_only=*/true)
                      .ok());
    }
  }
  // Header 32; each record: 48 bytes of fixed fields and strings, its
  // arrays padded to 8, an 8-byte checksum. far: 3 * 4 + 3 * 2 -> 24;
  // near: 8 + 10 * 2 gaps + 11 * 2 -> 56 (absolute positions: 72); empty: 0.
  EXPECT_EQ(std::filesystem::file_size(temp.path), 32u + (48 + 24 + 8) + (48 + 56 + 8) + (48 + 8));
  Result<std::unique_ptr<Journal>> journal = Journal::OpenIntactPrefix(temp.path);
  ASSERT_TRUE(journal.ok()) << journal.status().ToString();
  EXPECT_FALSE((*journal)->complete());
  ASSERT_EQ((*journal)->records().size(), 3u);
  std::vector<uint8_t> target(numel * 2, 0xee);
  for (size_t i = 0; i < sets.size(); ++i) {
    const JournalRecord& r = (*journal)->records()[i];
    EXPECT_TRUE(r.undo_only);
    EXPECT_EQ(r.new_values, nullptr);
    ASSERT_EQ(r.count, sets[i].size());
    for (size_t k = 0; k < sets[i].size(); ++k) {
      EXPECT_EQ(r.position(k), sets[i][k]) << i << " " << k;
      EXPECT_EQ(r.old_values[2 * k], static_cast<uint8_t>(sets[i][k]));
    }
    const JournalRecord* one = &r;
    Status replay = ApplyRecordsAndVisit({&one, 1}, target, false, 64, [](auto) {});
    EXPECT_EQ(replay.code(), StatusCode::kCorruption) << replay.ToString();
    EXPECT_EQ(r.Apply(target, /*undo=*/false).code(), StatusCode::kCorruption);
    ASSERT_TRUE(r.Apply(target, /*undo=*/true).ok());
  }
  for (size_t e = 0; e < numel; ++e) {
    const bool changed = std::find(far.begin(), far.end(), e) != far.end() ||
                         std::find(near.begin(), near.end(), e) != near.end();
    ASSERT_EQ(target[2 * e + 1], changed ? 0x0a : 0xee) << e;
  }
}

}  // namespace
}  // namespace deltasync::store_internal
