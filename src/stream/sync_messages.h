// The stream group's messages (docs/format.md, "Stream: commit protocol",
// "Messages"): a 16-byte envelope, then the body as a message of its own.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "deltasync/communicator.h"
#include "deltasync/dtype.h"
#include "deltasync/status.h"
#include "stream/state_digest.h"

namespace deltasync::stream {

inline constexpr size_t kEnvelopeBytes = 16;
// A body other than a frame's is at most this.
inline constexpr uint64_t kMaxControlBodyBytes = uint64_t{1} << 24;
inline constexpr int kStreamProtocol = 3;
// A shared frame's body travels down a chain of receivers in messages of
// at most this many bytes (docs/format.md, "Fan-out").
inline constexpr size_t kRelayChunkBytes = size_t{1} << 20;
// A JSON body's checksum: xxh3-64 of its text, after it.
inline constexpr size_t kJsonChecksumBytes = 8;

enum class MessageType : uint8_t { kHello = 1, kWelcome = 2, kFrame = 3, kReport = 4, kRoute = 5 };

// "hello", "welcome", "frame", "report", "route".
std::string_view MessageTypeName(MessageType type);

struct Envelope {
  MessageType type = MessageType::kHello;
  bool last = false;  // frames only
  bool end = false;   // frames only: no more shared frames (no body)
  uint64_t body_bytes = 0;
};

std::array<uint8_t, kEnvelopeBytes> EncodeEnvelope(const Envelope& envelope);
// Corruption for a wrong magic, an unknown type, a flag that is not a
// frame's `last` or `end`, an `end` with a body or with `last`, nonzero
// zero bytes, or a body past its type's bound.
Result<Envelope> DecodeEnvelope(std::span<const uint8_t, kEnvelopeBytes> bytes);

// Sends an envelope and, when `body` is not empty, the body.
Status SendMessage(Communicator& comm, int peer, MessageType type, bool last,
                   std::span<const uint8_t> body);
// A shared frame (docs/format.md, "Fan-out"): its envelope, then its body
// in relay chunks; SendEnd sends the envelope that ends a sync's shared
// frames.
Status SendShared(Communicator& comm, int peer, std::span<const uint8_t> frame);
Status SendEnd(Communicator& comm, int peer);
// Takes a shared frame's body of `into.size()` bytes from `from`, passing
// each chunk on to `to` (0: none) as it comes; `taken` (may be empty) sees
// each chunk once it is in.
Status RelayShared(Communicator& comm, int from, int to, std::span<uint8_t> into,
                   const Communicator::ChunkTaken& taken = nullptr);

// Where a sync's shared frames come from and go to (a `route`).
struct Route {
  int from = 0;
  int to = 0;
};
nlohmann::json RouteBody(const Route& route);
// Corruption naming the field for a malformed route, or one naming a rank
// outside the group of `size` (or this receiver's own, `self`).
Result<Route> ParseRoute(const nlohmann::json& body, int self, int size);

// Takes an envelope from `peer` and checks it is of type `expected`
// (InvalidArgument naming both otherwise); the body is still to be taken.
Result<Envelope> RecvEnvelope(Communicator& comm, int peer, MessageType expected);

// A JSON body's message, both ways (the text, then its checksum).
// RecvJson refuses a body whose checksum does not match or that is not a
// JSON object (Corruption). The Awaiting forms wait for the peer as
// Communicator::SendAwaiting and RecvAwaiting do.
Status SendJson(Communicator& comm, int peer, MessageType type, const nlohmann::json& body);
Result<nlohmann::json> RecvJson(Communicator& comm, int peer, MessageType expected);
Result<nlohmann::json> RecvJsonAwaiting(Communicator& comm, int peer, MessageType expected,
                                        std::optional<std::chrono::milliseconds> wait);
Status SendJsonAwaiting(Communicator& comm, int peer, MessageType type, const nlohmann::json& body,
                        std::optional<std::chrono::milliseconds> wait);
// RecvEnvelope whose wait for the envelope is `wait` (Communicator::RecvAwaiting).
Result<Envelope> RecvEnvelopeAwaiting(Communicator& comm, int peer, MessageType expected,
                                      std::optional<std::chrono::milliseconds> wait);
// The body of a JSON message as it travels, and its check (Corruption for
// a checksum that does not match or a body that is no JSON object).
std::vector<uint8_t> JsonBodyBytes(const nlohmann::json& body);
Result<nlohmann::json> ParseJsonBody(std::span<const uint8_t> bytes, std::string_view what);

// One registered tensor of a hello.
struct Registration {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  DigestBlock block;
};

// A receiver's hello (docs/format.md, "Messages").
struct Hello {
  std::vector<Registration> tensors;
  uint64_t max_frame_bytes = 0;  // the largest frame body it takes
  bool partial = false;          // it registered a subset of the tensors on purpose
};

nlohmann::json HelloBody(const Hello& hello);
// Corruption naming the field for a malformed hello (another protocol:
// Unsupported).
Result<Hello> ParseHello(const nlohmann::json& body);

// A receiver's report (docs/format.md, "Messages").
struct Report {
  Status status;      // OK, or the receiver's error
  bool clean = true;  // no byte of an unverified frame written
};

nlohmann::json ReportBody(const Report& report);
Result<Report> ParseReport(const nlohmann::json& body);

}  // namespace deltasync::stream
