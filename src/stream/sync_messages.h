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
inline constexpr int kStreamProtocol = 2;
// A JSON body's checksum: xxh3-64 of its text, after it.
inline constexpr size_t kJsonChecksumBytes = 8;

enum class MessageType : uint8_t { kHello = 1, kWelcome = 2, kFrame = 3, kReport = 4 };

// "hello", "welcome", "frame", "report".
std::string_view MessageTypeName(MessageType type);

struct Envelope {
  MessageType type = MessageType::kHello;
  bool last = false;  // frames only
  uint64_t body_bytes = 0;
};

std::array<uint8_t, kEnvelopeBytes> EncodeEnvelope(const Envelope& envelope);
// Corruption for a wrong magic, an unknown type, a flag that is not a
// frame's `last`, nonzero zero bytes, or a body past its type's bound.
Result<Envelope> DecodeEnvelope(std::span<const uint8_t, kEnvelopeBytes> bytes);

// Sends an envelope and, when `body` is not empty, the body.
Status SendMessage(Communicator& comm, int peer, MessageType type, bool last,
                   std::span<const uint8_t> body);
// Takes an envelope from `peer` and checks it is of type `expected`
// (InvalidArgument naming both otherwise); the body is still to be taken.
Result<Envelope> RecvEnvelope(Communicator& comm, int peer, MessageType expected);

// A JSON body's message, both ways (the text, then its checksum).
// RecvJson refuses a body whose checksum does not match or that is not a
// JSON object (Corruption). The Awaiting forms wait for the peer as
// Communicator::SendAwaiting and RecvAwaiting do.
Status SendJson(Communicator& comm, int peer, MessageType type, const nlohmann::json& body);
Result<nlohmann::json> RecvJson(Communicator& comm, int peer, MessageType expected);
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
