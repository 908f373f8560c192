// The authenticated mode (include/deltasync/communicator.h; docs/format.md,
// "Authenticated messages"): a wrapper that tags every message with a
// BLAKE3 keyed hash over its place in the group's traffic and its bytes,
// and checks the tag of every message it takes.
#include <sys/random.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/endian.h"
#include "deltasync/blake3.h"
#include "deltasync/communicator.h"

namespace deltasync {

namespace {

constexpr size_t kTagBytes = 32;
constexpr size_t kHeaderBytes = 64;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMinSecretBytes = 16;
constexpr uint32_t kEveryRank = 0xFFFFFFFFu;
constexpr std::string_view kKeyContext = "deltasync 2026-12 stream message authentication";

enum class TagOp : uint8_t {
  kPointToPoint = 1,
  kBroadcast = 2,
  kGather = 3,
  kAllGather = 4,
  kSession = 5,
};

using Tag = std::array<uint8_t, kTagBytes>;
using Session = std::array<uint8_t, 32>;

Tag MakeTag(const AuthKey& key, const Session& session, TagOp op, uint32_t from, uint32_t to,
            uint64_t sequence, std::span<const uint8_t> data) {
  uint8_t header[kHeaderBytes] = {'D', 'S', 'A', '1'};
  header[4] = static_cast<uint8_t>(op);
  StoreLe<uint32_t>(header + 8, from);
  StoreLe<uint32_t>(header + 12, to);
  StoreLe<uint64_t>(header + 16, sequence);
  StoreLe<uint64_t>(header + 24, data.size());
  std::memcpy(header + 32, session.data(), session.size());
  Blake3 h = Blake3::Keyed(key.bytes);
  h.Update(header);
  h.Update(data);
  Tag tag{};
  h.Finalize(tag);
  return tag;
}

// Constant time, so that a forger learns nothing from how fast a refusal
// comes.
bool SameTag(std::span<const uint8_t> a, const Tag& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < kTagBytes; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

class AuthCommunicator final : public Communicator {
 public:
  AuthCommunicator(std::unique_ptr<Communicator> inner, const AuthKey& key)
      : inner_(std::move(inner)),
        key_(key),
        name_("auth(" + std::string(inner_->name()) + ")"),
        sent_(inner_->size(), 0),
        received_(inner_->size(), 0) {}

  // The session (see the file comment of docs/format.md's section).
  Status MakeSession(std::string_view group) {
    std::array<uint8_t, kNonceBytes> nonce{};
    size_t got = 0;
    while (got < nonce.size()) {
      const ssize_t n = getrandom(nonce.data() + got, nonce.size() - got, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::IOError("authenticated mode: no random bytes: " +
                               std::string(std::strerror(errno)));
      }
      got += static_cast<size_t>(n);
    }
    std::vector<uint8_t> all(nonce.size() * static_cast<size_t>(size()));
    DS_RETURN_IF_ERROR(CheckedAllGather(TagOp::kSession, nonce, all));
    Blake3 h = Blake3::Keyed(key_.bytes);
    h.Update(std::span(reinterpret_cast<const uint8_t*>(group.data()), group.size()));
    const uint8_t zero = 0;
    h.Update(std::span(&zero, 1));
    h.Update(all);
    h.Finalize(session_);
    return Status::OK();
  }

  std::string_view name() const override { return name_; }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  uint64_t generation() const override { return inner_->generation(); }
  CommunicatorCapabilities capabilities() const override {
    CommunicatorCapabilities c = inner_->capabilities();
    c.device_buffers = false;  // the tags are computed on the host
    c.cuda_device = -1;
    return c;
  }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  Status health() const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!broken_.ok()) return broken_;
    }
    return inner_->health();
  }
  void Cancel(std::string_view why) override { inner_->Cancel(why); }

  Status Send(int peer, std::span<const uint8_t> data) override {
    return SendTagged(peer, data,
                      [&](std::span<const uint8_t> d) { return inner_->Send(peer, d); });
  }
  Status SendAwaiting(int peer, std::span<const uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return SendTagged(peer, data, [&](std::span<const uint8_t> d) {
      return inner_->SendAwaiting(peer, d, wait);
    });
  }
  Status Recv(int peer, std::span<uint8_t> data) override {
    return RecvTagged(peer, data, [&](std::span<uint8_t> d) { return inner_->Recv(peer, d); });
  }
  Status RecvAwaiting(int peer, std::span<uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return RecvTagged(peer, data,
                      [&](std::span<uint8_t> d) { return inner_->RecvAwaiting(peer, d, wait); });
  }

  Status Broadcast(int root, std::span<uint8_t> data) override {
    DS_RETURN_IF_ERROR(Usable());
    if (root < 0 || root >= size()) return inner_->Broadcast(root, data);  // its own error
    const uint64_t seq = collectives_++;
    const auto tag_of = [&] {
      return MakeTag(key_, session_, TagOp::kBroadcast, static_cast<uint32_t>(root), kEveryRank,
                     seq, data);
    };
    if (rank() == root) {
      Tag tag = tag_of();
      DS_RETURN_IF_ERROR(inner_->Broadcast(root, data));
      return inner_->Broadcast(root, tag);
    }
    DS_RETURN_IF_ERROR(inner_->Broadcast(root, data));
    Tag got{};
    DS_RETURN_IF_ERROR(inner_->Broadcast(root, got));
    if (!SameTag(got, tag_of())) return Forged("broadcast", root);
    return Status::OK();
  }

  Status Barrier() override {
    DS_RETURN_IF_ERROR(Usable());
    return inner_->Barrier();
  }

  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override {
    DS_RETURN_IF_ERROR(Usable());
    if (root < 0 || root >= size() ||
        (rank() == root && out.size() != record.size() * static_cast<size_t>(size()))) {
      return inner_->Gather(root, record, out);  // its own error
    }
    const uint64_t seq = collectives_++;
    const size_t n = record.size();
    std::vector<uint8_t> mine(record.begin(), record.end());
    const Tag tag = MakeTag(key_, session_, TagOp::kGather, static_cast<uint32_t>(rank()),
                            static_cast<uint32_t>(root), seq, record);
    mine.insert(mine.end(), tag.begin(), tag.end());
    std::vector<uint8_t> all(rank() == root ? (n + kTagBytes) * size() : 0);
    DS_RETURN_IF_ERROR(inner_->Gather(root, mine, all));
    if (rank() != root) return Status::OK();
    for (int p = 0; p < size(); ++p) {
      const std::span<const uint8_t> rec(all.data() + p * (n + kTagBytes), n);
      const Tag want = MakeTag(key_, session_, TagOp::kGather, static_cast<uint32_t>(p),
                               static_cast<uint32_t>(root), seq, rec);
      if (!SameTag(std::span(rec.data() + n, kTagBytes), want)) return Forged("gather", p);
      if (n > 0) std::memcpy(out.data() + p * n, rec.data(), n);
    }
    return Status::OK();
  }

  Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) override {
    DS_RETURN_IF_ERROR(Usable());
    if (out.size() != record.size() * static_cast<size_t>(size())) {
      return inner_->AllGather(record, out);  // its own error
    }
    return CheckedAllGather(TagOp::kAllGather, record, out);
  }

 private:
  Status Usable() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

  // A message whose tag did not verify: the communicator is broken, and
  // the inner one too (its peers' calls then fail at once).
  Status Forged(std::string_view call, int peer) {
    Status s = Status::Corruption(
        name_ + " " + std::string(call) + ": authentication failed: the message from rank " +
        std::to_string(peer) +
        " does not carry a valid tag (a forged, replayed or damaged message, or a member with "
        "another key)");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.ok()) broken_ = s;
    }
    inner_->Cancel("authentication failed");
    return s;
  }

  template <typename Call>
  Status SendTagged(int peer, std::span<const uint8_t> data, Call&& call) {
    DS_RETURN_IF_ERROR(Usable());
    if (peer < 0 || peer >= size() || peer == rank()) return call(data);  // inner's error
    const Tag tag = MakeTag(key_, session_, TagOp::kPointToPoint, static_cast<uint32_t>(rank()),
                            static_cast<uint32_t>(peer), sent_[peer]++, data);
    DS_RETURN_IF_ERROR(call(data));
    return inner_->Send(peer, tag);
  }

  template <typename Call>
  Status RecvTagged(int peer, std::span<uint8_t> data, Call&& call) {
    DS_RETURN_IF_ERROR(Usable());
    if (peer < 0 || peer >= size() || peer == rank()) return call(data);  // inner's error
    DS_RETURN_IF_ERROR(call(data));
    Tag got{};
    DS_RETURN_IF_ERROR(inner_->Recv(peer, got));
    const Tag want = MakeTag(key_, session_, TagOp::kPointToPoint, static_cast<uint32_t>(peer),
                             static_cast<uint32_t>(rank()), received_[peer]++, data);
    if (!SameTag(got, want)) return Forged("recv", peer);
    return Status::OK();
  }

  Status CheckedAllGather(TagOp op, std::span<const uint8_t> record, std::span<uint8_t> out) {
    const uint64_t seq = op == TagOp::kSession ? 0 : collectives_++;
    const size_t n = record.size();
    std::vector<uint8_t> mine(record.begin(), record.end());
    const Tag tag =
        MakeTag(key_, session_, op, static_cast<uint32_t>(rank()), kEveryRank, seq, record);
    mine.insert(mine.end(), tag.begin(), tag.end());
    std::vector<uint8_t> all((n + kTagBytes) * size());
    DS_RETURN_IF_ERROR(inner_->AllGather(mine, all));
    for (int p = 0; p < size(); ++p) {
      const std::span<const uint8_t> rec(all.data() + p * (n + kTagBytes), n);
      const Tag want = MakeTag(key_, session_, op, static_cast<uint32_t>(p), kEveryRank, seq, rec);
      if (!SameTag(std::span(rec.data() + n, kTagBytes), want)) return Forged("all-gather", p);
      if (n > 0) std::memcpy(out.data() + p * n, rec.data(), n);
    }
    return Status::OK();
  }

  std::unique_ptr<Communicator> inner_;
  const AuthKey key_;
  const std::string name_;
  Session session_{};  // all zero until MakeSession
  std::vector<uint64_t> sent_;
  std::vector<uint64_t> received_;
  uint64_t collectives_ = 0;
  mutable std::mutex mu_;  // broken_: health comes from any thread
  Status broken_;
};

}  // namespace

Result<AuthKey> DeriveAuthKey(std::string_view secret) {
  if (secret.size() < kMinSecretBytes) {
    return Status::InvalidArgument("a stream key's secret must be at least " +
                                   std::to_string(kMinSecretBytes) + " bytes, not " +
                                   std::to_string(secret.size()));
  }
  Blake3 h = Blake3::DeriveKey(kKeyContext);
  h.Update(std::span(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()));
  AuthKey key;
  h.Finalize(key.bytes);
  return key;
}

Result<std::optional<AuthKey>> AuthKeyFromEnvironment() {
  if (const char* file = std::getenv("DELTASYNC_STREAM_KEY_FILE"); file != nullptr && *file) {
    DS_ASSIGN_OR_RETURN(std::string secret, ReadSecretFile(file));
    DS_ASSIGN_OR_RETURN(AuthKey key, DeriveAuthKey(secret));
    return std::optional<AuthKey>(key);
  }
  if (const char* secret = std::getenv("DELTASYNC_STREAM_KEY"); secret != nullptr && *secret) {
    Result<AuthKey> key = DeriveAuthKey(secret);
    if (!key.ok()) {
      return Status(key.status().code(), "DELTASYNC_STREAM_KEY: " + key.status().message());
    }
    return std::optional<AuthKey>(*key);
  }
  return std::optional<AuthKey>();
}

Result<std::unique_ptr<Communicator>> AuthenticateCommunicator(std::unique_ptr<Communicator> inner,
                                                               const AuthKey& key,
                                                               std::string_view group) {
  if (!inner) return Status::InvalidArgument("AuthenticateCommunicator: no communicator");
  auto c = std::make_unique<AuthCommunicator>(std::move(inner), key);
  if (Status s = c->MakeSession(group); !s.ok()) {
    return Status(s.code(), "authenticated mode: making the session of group \"" +
                                std::string(group) + "\": " + s.message());
  }
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace deltasync
