#include "stream/sync_messages.h"

#include <algorithm>
#include <cstring>

#include "core/endian.h"
#include "deltasync/checksum.h"

namespace deltasync::stream {

namespace {

constexpr uint8_t kMagic[4] = {'D', 'S', 'S', 'M'};
constexpr uint8_t kFlagLast = 0x01;
constexpr uint8_t kFlagEnd = 0x02;
constexpr uint64_t kMaxFrameBody = uint64_t{1} << 40;

}  // namespace

std::string_view MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kHello: return "hello";
    case MessageType::kWelcome: return "welcome";
    case MessageType::kFrame: return "frame";
    case MessageType::kReport: return "report";
    case MessageType::kRoute: return "route";
  }
  return "unknown";
}

std::array<uint8_t, kEnvelopeBytes> EncodeEnvelope(const Envelope& envelope) {
  std::array<uint8_t, kEnvelopeBytes> out{};
  std::memcpy(out.data(), kMagic, 4);
  out[4] = static_cast<uint8_t>(envelope.type);
  out[5] = static_cast<uint8_t>((envelope.last ? kFlagLast : 0) | (envelope.end ? kFlagEnd : 0));
  StoreLe<uint64_t>(out.data() + 8, envelope.body_bytes);
  return out;
}

Result<Envelope> DecodeEnvelope(std::span<const uint8_t, kEnvelopeBytes> bytes) {
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) {
    return Status::Corruption("stream message: not a deltasync stream envelope (bad magic)");
  }
  const uint8_t type = bytes[4];
  if (type < 1 || type > 5) {
    return Status::Corruption("stream message: unknown type " + std::to_string(type));
  }
  Envelope e;
  e.type = static_cast<MessageType>(type);
  const uint8_t flags = bytes[5];
  if ((flags & ~(kFlagLast | kFlagEnd)) != 0 || (flags != 0 && e.type != MessageType::kFrame) ||
      flags == (kFlagLast | kFlagEnd)) {
    return Status::Corruption("stream message: " + std::string(MessageTypeName(e.type)) +
                              " envelope with flags " + std::to_string(flags));
  }
  if (bytes[6] != 0 || bytes[7] != 0) {
    return Status::Corruption("stream message: nonzero reserved bytes");
  }
  e.last = (flags & kFlagLast) != 0;
  e.end = (flags & kFlagEnd) != 0;
  e.body_bytes = LoadLe<uint64_t>(bytes.data() + 8);
  if (e.end && e.body_bytes != 0) {
    return Status::Corruption("stream message: an end envelope with a body of " +
                              std::to_string(e.body_bytes) + " bytes");
  }
  const uint64_t bound = e.type == MessageType::kFrame ? kMaxFrameBody : kMaxControlBodyBytes;
  if (e.body_bytes > bound) {
    return Status::Corruption("stream message: a " + std::string(MessageTypeName(e.type)) +
                              " body of " + std::to_string(e.body_bytes) +
                              " bytes, past its bound of " + std::to_string(bound));
  }
  return e;
}

namespace {

Status SendMessageWaiting(Communicator& comm, int peer, MessageType type, bool last,
                          std::span<const uint8_t> body, bool awaiting,
                          std::optional<std::chrono::milliseconds> wait) {
  const std::array<uint8_t, kEnvelopeBytes> env = EncodeEnvelope({type, last, false, body.size()});
  DS_RETURN_IF_ERROR(awaiting ? comm.SendAwaiting(peer, env, wait) : comm.Send(peer, env));
  if (!body.empty()) DS_RETURN_IF_ERROR(comm.Send(peer, body));
  return Status::OK();
}

Result<Envelope> RecvEnvelopeWaiting(Communicator& comm, int peer, MessageType expected,
                                     bool awaiting, std::optional<std::chrono::milliseconds> wait) {
  std::array<uint8_t, kEnvelopeBytes> env{};
  DS_RETURN_IF_ERROR(awaiting ? comm.RecvAwaiting(peer, env, wait) : comm.Recv(peer, env));
  DS_ASSIGN_OR_RETURN(Envelope e, DecodeEnvelope(env));
  if (e.type != expected) {
    return Status::InvalidArgument("stream message from rank " + std::to_string(peer) + ": a " +
                                   std::string(MessageTypeName(e.type)) + ", expected a " +
                                   std::string(MessageTypeName(expected)));
  }
  return e;
}

}  // namespace

Status SendMessage(Communicator& comm, int peer, MessageType type, bool last,
                   std::span<const uint8_t> body) {
  return SendMessageWaiting(comm, peer, type, last, body, false, std::nullopt);
}

Result<Envelope> RecvEnvelope(Communicator& comm, int peer, MessageType expected) {
  return RecvEnvelopeWaiting(comm, peer, expected, false, std::nullopt);
}

Result<Envelope> RecvEnvelopeAwaiting(Communicator& comm, int peer, MessageType expected,
                                      std::optional<std::chrono::milliseconds> wait) {
  return RecvEnvelopeWaiting(comm, peer, expected, true, wait);
}

std::vector<uint8_t> JsonBodyBytes(const nlohmann::json& body) {
  const std::string text = body.dump();
  std::vector<uint8_t> out(text.begin(), text.end());
  const std::vector<uint8_t> sum =
      ChecksumBytes(ChecksumAlgo::kXxh3_64, std::span<const uint8_t>(out));
  out.insert(out.end(), sum.begin(), sum.end());
  return out;
}

Result<nlohmann::json> ParseJsonBody(std::span<const uint8_t> bytes, std::string_view what) {
  if (bytes.size() < kJsonChecksumBytes) {
    return Status::Corruption(std::string(what) + ": " + std::to_string(bytes.size()) +
                              " bytes, too few for a JSON body and its checksum");
  }
  const std::span<const uint8_t> text = bytes.first(bytes.size() - kJsonChecksumBytes);
  const std::vector<uint8_t> sum = ChecksumBytes(ChecksumAlgo::kXxh3_64, text);
  if (!std::equal(sum.begin(), sum.end(), bytes.end() - kJsonChecksumBytes)) {
    return Status::Corruption(std::string(what) + ": checksum mismatch (the message was damaged)");
  }
  nlohmann::json body = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                              /*allow_exceptions=*/false);
  if (!body.is_object()) return Status::Corruption(std::string(what) + ": not a JSON object");
  return body;
}

Status SendJson(Communicator& comm, int peer, MessageType type, const nlohmann::json& body) {
  return SendMessage(comm, peer, type, false, JsonBodyBytes(body));
}

Status SendJsonAwaiting(Communicator& comm, int peer, MessageType type, const nlohmann::json& body,
                        std::optional<std::chrono::milliseconds> wait) {
  return SendMessageWaiting(comm, peer, type, false, JsonBodyBytes(body), true, wait);
}

Status SendShared(Communicator& comm, int peer, std::span<const uint8_t> frame) {
  const std::array<uint8_t, kEnvelopeBytes> env =
      EncodeEnvelope({MessageType::kFrame, false, false, frame.size()});
  DS_RETURN_IF_ERROR(comm.Send(peer, env));
  for (size_t at = 0; at < frame.size(); at += kRelayChunkBytes) {
    DS_RETURN_IF_ERROR(
        comm.Send(peer, frame.subspan(at, std::min(kRelayChunkBytes, frame.size() - at))));
  }
  return Status::OK();
}

Status SendEnd(Communicator& comm, int peer) {
  return comm.Send(peer, EncodeEnvelope({MessageType::kFrame, false, true, 0}));
}

Status RelayShared(Communicator& comm, int from, int to, std::span<uint8_t> into,
                   const Communicator::ChunkTaken& taken) {
  return comm.Relay(from, to == 0 ? -1 : to, into, kRelayChunkBytes, taken);
}

nlohmann::json RouteBody(const Route& route) { return {{"from", route.from}, {"to", route.to}}; }

Result<Route> ParseRoute(const nlohmann::json& body, int self, int size) {
  Route r;
  for (const auto& [key, slot] : {std::pair<const char*, int*>{"from", &r.from}, {"to", &r.to}}) {
    if (!body.contains(key) || !body[key].is_number_integer()) {
      return Status::Corruption(std::string("stream route: no integer \"") + key + "\"");
    }
    const int64_t v = body[key].get<int64_t>();
    if (v < 0 || v >= size || v == self) {
      return Status::Corruption(std::string("stream route: \"") + key + "\" is rank " +
                                std::to_string(v) + ", not another member of the group of " +
                                std::to_string(size));
    }
    *slot = static_cast<int>(v);
  }
  if (r.to != 0 && r.to == r.from) {
    return Status::Corruption("stream route: frames come from and go to rank " +
                              std::to_string(r.to));
  }
  return r;
}

Result<nlohmann::json> RecvJsonAwaiting(Communicator& comm, int peer, MessageType expected,
                                        std::optional<std::chrono::milliseconds> wait) {
  DS_ASSIGN_OR_RETURN(Envelope e, RecvEnvelopeAwaiting(comm, peer, expected, wait));
  std::vector<uint8_t> bytes(e.body_bytes);
  if (!bytes.empty()) DS_RETURN_IF_ERROR(comm.Recv(peer, bytes));
  return ParseJsonBody(bytes, "stream " + std::string(MessageTypeName(expected)) + " from rank " +
                                  std::to_string(peer));
}

Result<nlohmann::json> RecvJson(Communicator& comm, int peer, MessageType expected) {
  DS_ASSIGN_OR_RETURN(Envelope e, RecvEnvelope(comm, peer, expected));
  std::vector<uint8_t> bytes(e.body_bytes);
  if (!bytes.empty()) DS_RETURN_IF_ERROR(comm.Recv(peer, bytes));
  return ParseJsonBody(bytes, "stream " + std::string(MessageTypeName(expected)) + " from rank " +
                                  std::to_string(peer));
}

nlohmann::json HelloBody(const Hello& hello) {
  nlohmann::json list = nlohmann::json::array();
  for (const Registration& t : hello.tensors) {
    list.push_back({{"name", t.name},
                    {"dtype", std::string(DTypeName(t.dtype))},
                    {"shape", t.shape},
                    {"block", {t.block.first, t.block.count, t.block.rows, t.block.row_stride}}});
  }
  return {{"protocol", kStreamProtocol},
          {"max_frame_bytes", hello.max_frame_bytes},
          {"partial", hello.partial},
          {"tensors", std::move(list)}};
}

Result<Hello> ParseHello(const nlohmann::json& body) {
  const auto bad = [](const std::string& what) {
    return Status::Corruption("stream hello: " + what);
  };
  if (!body.contains("protocol") || !body["protocol"].is_number_integer()) {
    return bad("no protocol number");
  }
  if (body["protocol"].get<int64_t>() != kStreamProtocol) {
    return Status::Unsupported("stream hello: protocol " + body["protocol"].dump() +
                               ", this build speaks " + std::to_string(kStreamProtocol));
  }
  Hello hello;
  if (!body.contains("max_frame_bytes") || !body["max_frame_bytes"].is_number_unsigned()) {
    return bad("no max_frame_bytes");
  }
  hello.max_frame_bytes = body["max_frame_bytes"].get<uint64_t>();
  if (!body.contains("partial") || !body["partial"].is_boolean()) return bad("no partial flag");
  hello.partial = body["partial"].get<bool>();
  if (!body.contains("tensors") || !body["tensors"].is_array()) return bad("no tensor list");
  std::vector<Registration>& out = hello.tensors;
  for (const nlohmann::json& t : body["tensors"]) {
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
      return bad("a tensor without a name");
    }
    Registration r;
    r.name = t["name"].get<std::string>();
    const std::string what = "tensor '" + r.name + "'";
    if (!t.contains("dtype") || !t["dtype"].is_string()) return bad(what + ": no dtype");
    Result<DType> dtype = ParseDType(t["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(what + ": " + dtype.status().message());
    r.dtype = *dtype;
    if (!t.contains("shape") || !t["shape"].is_array()) return bad(what + ": no shape");
    for (const nlohmann::json& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad(what + ": a bad dimension");
      r.shape.push_back(d.get<int64_t>());
    }
    if (!t.contains("block") || !t["block"].is_array() || t["block"].size() != 4) {
      return bad(what + ": no block");
    }
    for (const nlohmann::json& v : t["block"]) {
      if (!v.is_number_unsigned()) return bad(what + ": a bad block");
    }
    r.block = {t["block"][0].get<uint64_t>(), t["block"][1].get<uint64_t>(),
               t["block"][2].get<uint64_t>(), t["block"][3].get<uint64_t>()};
    if (Status s = r.block.Validate(); !s.ok()) return bad(what + ": " + s.message());
    out.push_back(std::move(r));
  }
  return hello;
}

nlohmann::json ReportBody(const Report& report) {
  if (report.status.ok()) return {{"ok", true}};
  return {{"ok", false},
          {"code", std::string(StatusCodeName(report.status.code()))},
          {"error", report.status.message()},
          {"clean", report.clean}};
}

Result<Report> ParseReport(const nlohmann::json& body) {
  if (!body.contains("ok") || !body["ok"].is_boolean()) {
    return Status::Corruption("stream report: no ok field");
  }
  Report r;
  if (body["ok"].get<bool>()) return r;
  const std::string error = body.contains("error") && body["error"].is_string()
                                ? body["error"].get<std::string>()
                                : std::string("(no error text)");
  StatusCode code = StatusCode::kAborted;
  if (body.contains("code") && body["code"].is_string()) {
    for (int c = 1; c <= static_cast<int>(StatusCode::kUnavailable); ++c) {
      if (StatusCodeName(static_cast<StatusCode>(c)) == body["code"].get<std::string>()) {
        code = static_cast<StatusCode>(c);
      }
    }
  }
  r.status = Status(code, error);
  // Without the field, assume the worst: the receiver is reseeded.
  r.clean = body.contains("clean") && body["clean"].is_boolean() && body["clean"].get<bool>();
  return r;
}

}  // namespace deltasync::stream
