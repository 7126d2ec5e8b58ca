// shard_worker: a reference shardkit contract v1 worker in C++.
//
// It implements shardkit.v1.ShardEngineService (shardkit/proto/shard_engine.proto; the
// Makefile generates the stubs from that file) with gRPC and protobuf only. Copy it to start
// a worker for your own engine: replace the class Engine's numerics (Forward) with your
// model and keep the rest, which is the session lifecycle of contract §2 rule by rule.
//
//   shard_worker --listen unix:/tmp/w.sock      (or HOST:PORT; port 0 picks a free one)
//
// prints "listening on ADDRESS" once it serves, and exits when its stdin reaches end of file
// (so a parent that dies, even by kill -9, leaves no worker behind) or on SIGTERM/SIGINT.
//
// The engine: a 4-layer model (hidden size 8, vocab 32, float32, 4 sessions, 64 KV tokens)
// with hash "numerics". Each layer keeps, per session epoch, a 64-bit hash chain over the rows
// it has consumed (that chain is the layer's "KV cache") and emits a row derived from it. A
// row therefore depends on exactly the rows before it, however the history was chunked, and
// a head -> middle -> tail split hashes the same bytes as the full model, so every role of
// contract §1 is served and composition (§3) holds bit for bit. Same calls, same answers:
// nothing reads a clock or a random source.
//
// Compile-time plants (make PLANT=...), bugs the kit must find:
//   PLANT_CANCEL_LEAK  cancel keeps the session's KV tokens counted (a §2 metrics bug).
//   PLANT_NULL_DEREF   a genuine SIGSEGV: see Engine::Advance.

#include <cxxabi.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "shard_engine.grpc.pb.h"

namespace pb = shardkit::v1;

namespace {

constexpr char kProtocolVersion[] = "shardkit.v1/1";
constexpr char kArchitecture[] = "cpp-hash";
constexpr int64_t kTotalLayers = 4, kHiddenSize = 8, kVocabSize = 32;
constexpr int64_t kMaxSessions = 4, kMaxKvTokens = 64;
constexpr size_t kRowBytes = kHiddenSize * sizeof(float);  // one float32 residual row
constexpr size_t kMaxEngines = 256;  // a client that never closes its engines cannot grow us

// --- hash numerics ---------------------------------------------------------------------------

uint64_t Splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// One link of a chain: FNV-1a over the bytes, started from the previous link.
uint64_t Chain(uint64_t previous, const std::string& bytes) {
  uint64_t h = previous ^ 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return Splitmix(h);
}

// A residual row from a chain link: 8 float32 values in [0, 1), each with 24 random bits, so
// every value is finite and exact. Bytes are little-endian on the wire; this assumes a
// little-endian host (x86-64, arm64).
std::string RowFrom(uint64_t link) {
  std::string row(kRowBytes, '\0');
  for (int64_t k = 0; k < kHiddenSize; ++k) {
    float value = static_cast<float>(Splitmix(link + k) >> 40) / 16777216.0f;
    std::memcpy(&row[k * sizeof(float)], &value, sizeof(float));
  }
  return row;
}

// --- small helpers ---------------------------------------------------------------------------

pb::StructuredStatus Status(pb::StatusCode code, const std::string& message = "", bool retryable = false) {
  pb::StructuredStatus status;
  status.set_code(code);
  status.set_message(message);
  status.set_retryable(retryable);
  return status;
}

// Every refusal of a step: the status, cache MISS, no output (contract §2).
pb::StepResult Refusal(pb::StatusCode code, const std::string& message, bool retryable = false) {
  pb::StepResult result;
  *result.mutable_status() = Status(code, message, retryable);
  result.set_cache(pb::CACHE_RESULT_MISS);
  return result;
}

// An epoch or step, or nullopt when it lies outside [0, 2**63). The kit sends 2**63 as a
// *_decimal string: every such value is out of range, so we never parse it. Absent means 0.
template <class M>
std::optional<int64_t> EpochOf(const M& m) {
  if (m.epoch_value_case() == M::kEpochDecimal) return std::nullopt;
  int64_t v = m.epoch_value_case() == M::kEpoch ? m.epoch() : 0;
  return v >= 0 ? std::optional<int64_t>(v) : std::nullopt;
}
template <class M>
std::optional<int64_t> StepOf(const M& m) {
  if (m.step_value_case() == M::kStepDecimal) return std::nullopt;
  int64_t v = m.step_value_case() == M::kStep ? m.step() : 0;
  return v >= 0 ? std::optional<int64_t>(v) : std::nullopt;
}

enum class Op { kPrefill, kDecode };
const char* Name(Op op) { return op == Op::kPrefill ? "prefill" : "decode"; }

// --- the engine: contract §2, rule by rule ----------------------------------------------------

struct Session {
  int64_t epoch = 0;
  int64_t next_step = 0;
  int64_t kv_tokens = 0;
  bool cancelled = false;
  std::vector<uint64_t> chains;  // one per served layer: this session epoch's "KV cache"
  std::string last_key;          // the last accepted request, for rule 6 retries
  pb::StepResult last_result;    // ... and exactly what it answered
  int64_t decodes = 0;           // accepted decodes in this epoch (used by PLANT_NULL_DEREF)
};

class Engine {
 public:
  // The server holds this while it runs one call, plus the answer sent ahead (with_metrics,
  // with_capabilities): calls to one engine never overlap, so the engine is linearizable and
  // may declare concurrent_calls.
  std::mutex mu;

  // load() either returns a LoadResult or refuses (Python's EngineError: the `error` member).
  pb::LoadResponse Load(const pb::LoadRequest& request) {
    pb::LoadResponse response;
    auto refuse = [&](pb::StatusCode code, const std::string& message) {
      *response.mutable_error() = Status(code, message);
      return response;
    };
    if (loaded_) return refuse(pb::STATUS_CODE_FAILED_PRECONDITION, "already loaded; build a fresh engine");
    if (request.total_layers() != kTotalLayers)
      return refuse(pb::STATUS_CODE_INVALID_ARGUMENT, "total_layers=" + std::to_string(request.total_layers()) +
                                                          ", but the model has " + std::to_string(kTotalLayers));
    if (!(0 <= request.shard_start() && request.shard_start() <= request.shard_end() &&
          request.shard_end() < kTotalLayers))
      return refuse(pb::STATUS_CODE_INVALID_ARGUMENT, "needs 0 <= shard_start <= shard_end < total_layers");
    // To serve the full model only, refuse other ranges here (the kit then draws only the
    // roles that load): refuse(pb::STATUS_CODE_INVALID_ARGUMENT, "this worker serves ...").
    loaded_ = true;
    start_ = request.shard_start();
    end_ = request.shard_end();
    // The model id picks the "weights"; twins and split halves get the same id, so the same numbers.
    seed_ = Chain(0, "cpp-worker:" + request.model_id());
    response.mutable_result()->set_architecture(kArchitecture);
    *response.mutable_result()->mutable_status() = Status(pb::STATUS_CODE_OK);
    return response;
  }

  // Before load: the largest range it can load; after: the range it loaded.
  pb::EngineCapabilities Capabilities() const {
    pb::EngineCapabilities caps;
    caps.set_architecture(kArchitecture);
    caps.set_evidence_class("fixture");
    caps.set_total_layers(kTotalLayers);
    caps.set_shard_start(loaded_ ? start_ : 0);
    caps.set_shard_end(loaded_ ? end_ : kTotalLayers - 1);
    caps.set_hidden_size(kHiddenSize);
    caps.set_vocab_size(kVocabSize);
    caps.set_dtype("float32");
    caps.set_max_sessions(kMaxSessions);
    caps.set_max_kv_tokens(kMaxKvTokens);
    // No supported_faults: the kit injects delay, malformed_output and crash at its end.
    caps.set_tolerance(0.0);  // bit-exact
    caps.set_concurrent_calls(true);  // true because of `mu` above
    return caps;
  }

  pb::StepResult Step(Op op, const pb::StepRequest& request) {
    (op == Op::kPrefill ? prefill_calls_ : decode_calls_) += 1;  // refused calls count too
    const char* name = Name(op);
    if (!loaded_) return Refusal(pb::STATUS_CODE_UNAVAILABLE, std::string(name) + " before load");  // rule 1
    std::optional<int64_t> epoch = EpochOf(request), step = StepOf(request);
    std::vector<std::string> rows;  // the input, one byte string per token or bundle row
    std::string problem = InputProblem(op, request, epoch, step, &rows);
    if (!problem.empty()) return Refusal(pb::STATUS_CODE_INVALID_ARGUMENT, std::string(name) + ": " + problem);  // rule 2
    auto found = sessions_.find(request.session_id());
    Session* session = found == sessions_.end() ? nullptr : &found->second;
    bool opens = op == Op::kPrefill && *step == 0;
    if (session == nullptr || *epoch > session->epoch) {  // rules 3 and 4 (a higher epoch)
      if (opens) return Advance(op, request, session, *epoch, rows);
      auto code = session == nullptr && op == Op::kPrefill ? pb::STATUS_CODE_FAILED_PRECONDITION
                                                           : pb::STATUS_CODE_NOT_FOUND;
      return Refusal(code, std::string(name) + ": no such session epoch; open one with prefill step 0");
    }
    if (*epoch < session->epoch)  // rule 4 (stale)
      return Refusal(pb::STATUS_CODE_ABORTED, std::string(name) + ": stale epoch, the session is at " +
                                                  std::to_string(session->epoch));
    if (session->cancelled) return Refusal(pb::STATUS_CODE_CANCELLED, std::string(name) + ": cancelled");  // rule 5
    // Rule 6: an exact repeat of the last accepted request answers exactly what it answered.
    if (*step == session->next_step - 1 && RetryKey(op, request) == session->last_key) return session->last_result;
    if (*step != session->next_step)
      return Refusal(pb::STATUS_CODE_FAILED_PRECONDITION,
                     std::string(name) + ": expected step " + std::to_string(session->next_step));
    return Advance(op, request, session, *epoch, rows);
  }

  pb::StructuredStatus Cancel(const std::string& session_id, std::optional<int64_t> epoch) {
    if (!loaded_) return Status(pb::STATUS_CODE_UNAVAILABLE, "cancel before load");
    if (session_id.empty() || !epoch)
      return Status(pb::STATUS_CODE_INVALID_ARGUMENT, "cancel: empty session id, or an epoch outside [0, 2**63)");
    auto found = sessions_.find(session_id);
    if (found == sessions_.end() || *epoch > found->second.epoch)
      return Status(pb::STATUS_CODE_NOT_FOUND, "cancel: no such session epoch");
    Session& session = found->second;
    if (*epoch < session.epoch) return Status(pb::STATUS_CODE_ABORTED, "cancel: stale epoch");
    // The session keeps its slot and answers CANCELLED until a release or a restart; its cache goes now.
    session.cancelled = true;
    session.chains.clear();
#ifndef PLANT_CANCEL_LEAK
    session.kv_tokens = 0;
#endif  // PLANT_CANCEL_LEAK: the tokens stay counted (metrics kv_tokens, and rule 7's budget)
    return Status(pb::STATUS_CODE_OK);
  }

  pb::StructuredStatus Release(const std::string& session_id) {
    if (!loaded_) return Status(pb::STATUS_CODE_UNAVAILABLE, "release before load");
    sessions_.erase(session_id);  // an unknown id (the empty one too) is fine: release is idempotent
    return Status(pb::STATUS_CODE_OK);
  }

  pb::HealthResult Health() const {
    pb::HealthResult health;
    *health.mutable_status() = loaded_ ? Status(pb::STATUS_CODE_OK) : Status(pb::STATUS_CODE_UNAVAILABLE, "not loaded");
    health.set_serving(loaded_);
    return health;
  }

  pb::MetricsResult Metrics() const {
    pb::MetricsResult metrics;
    metrics.set_prefill_calls(prefill_calls_);
    metrics.set_decode_calls(decode_calls_);
    metrics.set_active_sessions(static_cast<int64_t>(sessions_.size()));  // cancelled ones hold a slot
    metrics.set_kv_tokens(KvTokensUsed());
    return metrics;
  }

 private:
  std::string Role() const {
    if (start_ == 0) return end_ == kTotalLayers - 1 ? "full" : "head";
    return end_ == kTotalLayers - 1 ? "tail" : "middle";
  }

  int64_t KvTokensUsed() const {
    int64_t used = 0;
    for (const auto& entry : sessions_) used += entry.second.kv_tokens;
    return used;
  }

  // What makes a retry "the same request" (rule 6): the operation and the input's every byte
  // (epoch and step are the session's and next_step - 1 when this is compared). The kit
  // encodes a resent request exactly as the first, so serialized bytes compare equal.
  static std::string RetryKey(Op op, const pb::StepRequest& request) {
    std::string key = Name(op);
    key += request.has_bundle() ? "|bundle|" + request.bundle().SerializeAsString()
                                : "|tokens|" + request.token_ids().SerializeAsString();
    return key;
  }

  // Rule 2: why the request is malformed ("" if it is not); fills `rows` with its input.
  std::string InputProblem(Op op, const pb::StepRequest& request, std::optional<int64_t> epoch,
                           std::optional<int64_t> step, std::vector<std::string>* rows) const {
    if (request.session_id().empty()) return "empty session id";
    if (!epoch || !step) return "epoch or step outside [0, 2**63)";
    std::string role = Role();
    if (role == "full" || role == "head") {
      if (!request.has_token_ids()) return "a " + role + " shard takes token_ids";
      for (int64_t id : request.token_ids().ids()) {
        if (id < 0 || id >= kVocabSize) return "token ids outside [0, 32)";
        rows->push_back(std::string(reinterpret_cast<const char*>(&id), sizeof id));  // little-endian host
      }
    } else {
      if (!request.has_bundle()) return "a " + role + " shard takes a bundle";
      std::string problem = BundleProblem(request, epoch, step, rows);
      if (!problem.empty()) return problem;
    }
    if (rows->empty()) return "empty input";
    if (op == Op::kDecode && rows->size() != 1) return "a decode takes exactly one token or row";
    return "";
  }

  std::string BundleProblem(const pb::StepRequest& request, std::optional<int64_t> epoch,
                            std::optional<int64_t> step, std::vector<std::string>* rows) const {
    const pb::BoundaryBundle& bundle = request.bundle();
    if (bundle.session_id() != request.session_id() || EpochOf(bundle) != epoch || StepOf(bundle) != step)
      return "the bundle's session_id, epoch or step differ from the request's";
    if (bundle.architecture() != kArchitecture) return "the bundle's architecture is not " + std::string(kArchitecture);
    bool upstream = bundle.boundary_point() == "post_head_residual" ||
                    (Role() == "tail" && bundle.boundary_point() == "post_middle_residual");
    if (!upstream) return "boundary point " + bundle.boundary_point() + " is not upstream of a " + Role();
    if (bundle.tensors_size() != 1 || bundle.tensors(0).name() != "residual")
      return "a bundle holds exactly one tensor, named residual";
    const pb::EngineTensor& tensor = bundle.tensors(0);
    if (tensor.dtype() != "float32") return "the residual's dtype must be float32";
    if (tensor.shape_size() != 2 || tensor.shape(1) != static_cast<uint64_t>(kHiddenSize))
      return "the residual's shape must be (rows, 8)";
    const std::string& data = tensor.data();  // compare by division: shape(0) may be huge
    if (data.size() % kRowBytes != 0 || data.size() / kRowBytes != tensor.shape(0))
      return "the residual's data length does not match its shape";
    if (bundle.has_token_id_sideband() && static_cast<uint64_t>(bundle.token_id_sideband().ids_size()) != tensor.shape(0))
      return "the sideband's length differs from the row count";
    for (size_t at = 0; at < data.size(); at += sizeof(float)) {
      float value;
      std::memcpy(&value, data.data() + at, sizeof value);
      if (!std::isfinite(value)) return "the residual holds a non-finite value";
    }
    for (size_t at = 0; at < data.size(); at += kRowBytes) rows->push_back(data.substr(at, kRowBytes));
    return "";
  }

  // Rules 7 and 8 for a request that opens, restarts or continues a session epoch.
  pb::StepResult Advance(Op op, const pb::StepRequest& request, Session* session, int64_t epoch,
                         const std::vector<std::string>& rows) {
    bool continues = session != nullptr && session->epoch == epoch;
    if (session == nullptr && static_cast<int64_t>(sessions_.size()) >= kMaxSessions)
      return Refusal(pb::STATUS_CODE_RESOURCE_EXHAUSTED, "no free session slot", true);
    int64_t used = KvTokensUsed();
    if (session != nullptr && !continues) used -= session->kv_tokens;  // an admitted restart gives them back
    if (used + static_cast<int64_t>(rows.size()) > kMaxKvTokens)
      return Refusal(pb::STATUS_CODE_RESOURCE_EXHAUSTED, "not enough KV cache", true);

#ifdef PLANT_NULL_DEREF
    // The planted native crash: the second accepted decode of a session epoch above 0 writes
    // through a null pointer. Reaching it takes a prefill at epoch >= 1 and two decodes, never
    // the first step; the twins never reach it (they run at epoch 0). `volatile` keeps the
    // compiler from proving the pointer null and turning the store into a trap (SIGILL).
    if (op == Op::kDecode && continues && epoch > 0 && session->decodes == 1) {
      int* volatile nowhere = nullptr;
      *nowhere = 1;  // SIGSEGV
    }
#endif

    // The numerics: each served layer folds each row into its chain and emits the next row.
    std::vector<uint64_t> chains = continues ? session->chains : std::vector<uint64_t>();
    for (int64_t layer = start_; !continues && layer <= end_; ++layer) chains.push_back(Splitmix(seed_ + layer));
    std::string residual;  // the last layer's output rows, one per input row
    for (std::string row : rows) {
      for (uint64_t& link : chains) {
        link = Chain(link, row);
        row = RowFrom(link);
      }
      residual += row;
    }

    pb::StepResult result;
    *result.mutable_status() = Status(pb::STATUS_CODE_OK);
    result.set_cache(continues ? pb::CACHE_RESULT_HIT : pb::CACHE_RESULT_MISS);
    std::string role = Role();
    if (role == "full" || role == "tail") {
      result.mutable_token()->set_token_id(static_cast<int64_t>(Splitmix(chains.back()) % kVocabSize));
    } else {  // a head or a middle answers a bundle that echoes the request
      pb::BoundaryBundle* out = result.mutable_bundle();
      out->set_session_id(request.session_id());
      out->set_epoch(epoch);
      out->set_step(*StepOf(request));
      out->set_boundary_point(role == "head" ? "post_head_residual" : "post_middle_residual");
      out->set_architecture(kArchitecture);
      pb::EngineTensor* tensor = out->add_tensors();
      tensor->set_name("residual");
      tensor->set_dtype("float32");
      tensor->add_shape(rows.size());
      tensor->add_shape(kHiddenSize);
      tensor->set_data(residual);
      // A head's sideband is its input ids; a middle passes its input's through (absent stays absent).
      if (request.has_token_ids()) *out->mutable_token_id_sideband() = request.token_ids();
      else if (request.bundle().has_token_id_sideband()) *out->mutable_token_id_sideband() = request.bundle().token_id_sideband();
    }

    if (continues) {
      session->next_step += 1;
      session->kv_tokens += static_cast<int64_t>(rows.size());
    } else {  // open, or restart (which clears a cancellation and drops the old epoch's cache)
      session = &sessions_[request.session_id()];
      *session = Session();
      session->epoch = epoch;
      session->next_step = 1;
      session->kv_tokens = static_cast<int64_t>(rows.size());
    }
    session->chains = std::move(chains);
    session->decodes += op == Op::kDecode ? 1 : 0;
    session->last_key = RetryKey(op, request);
    session->last_result = result;
    return result;
  }

  bool loaded_ = false;
  int64_t start_ = 0, end_ = 0;
  uint64_t seed_ = 0;
  std::map<std::string, Session> sessions_;
  int64_t prefill_calls_ = 0, decode_calls_ = 0;
};

// --- the gRPC service: engines by id ---------------------------------------------------------

class Service final : public pb::ShardEngineService::Service {
 public:
  explicit Service(std::string server_id) : server_id_(std::move(server_id)) {}

  grpc::Status Handshake(grpc::ServerContext*, const pb::HandshakeRequest* request,
                         pb::HandshakeResponse* response) override {
    if (request->protocol_version() != kProtocolVersion)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "the client speaks '" + request->protocol_version() +
                                                                     "', this server speaks '" + kProtocolVersion + "'");
    response->set_protocol_version(kProtocolVersion);
    response->set_server("shard_worker (C++ reference)");
    response->set_target("cpp-hash");
    response->set_server_id(server_id_);
    response->add_calls("Calls");  // the optional RPCs this worker has
    return grpc::Status::OK;
  }

  // Every call but Handshake over one stream (the client keeps one per thread): each Call is run
  // as the unary RPC it names and answered, in order, with what that RPC would have ended with.
  // It saves the client about half of a unary RPC's cost per call.
  grpc::Status Calls(grpc::ServerContext*, grpc::ServerReaderWriter<pb::Answer, pb::Call>* stream) override {
    pb::Call call;
    while (stream->Read(&call)) {
      if (!stream->Write(AnswerTo(call))) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status NewEngine(grpc::ServerContext*, const pb::NewEngineRequest* request,
                         pb::NewEngineResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t id : request->close_engine_ids()) engines_.erase(id);  // saves the client a CloseEngine each
    uint64_t id = next_id_++;
    engines_[id] = std::make_shared<Engine>();
    // Ids grow, so the map's first entry is the oldest engine: drop it past the limit.
    while (engines_.size() > kMaxEngines) engines_.erase(engines_.begin());
    response->set_engine_id(id);
    response->set_server_id(server_id_);
    response->set_closed_engine_ids(true);
    return grpc::Status::OK;
  }

  grpc::Status CloseEngine(grpc::ServerContext*, const pb::EngineRef* ref, pb::CloseEngineResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_closed(engines_.erase(ref->engine_id()) > 0);
    return grpc::Status::OK;
  }

  grpc::Status Load(grpc::ServerContext* context, const pb::LoadCall* call, pb::LoadResponse* response) override {
    return WithEngine(context, call->engine_id(), [&](Engine& engine) {
      *response = engine.Load(call->request());
      // with_capabilities: answer the kit's next call now, before any other call to this engine.
      if (call->with_capabilities() && response->has_result())
        *response->mutable_capabilities()->mutable_capabilities() = engine.Capabilities();
    });
  }

  grpc::Status Capabilities(grpc::ServerContext* context, const pb::EngineRef* ref, pb::CapabilitiesResponse* response) override {
    return WithEngine(context, ref->engine_id(), [&](Engine& engine) { *response->mutable_capabilities() = engine.Capabilities(); });
  }

  grpc::Status Prefill(grpc::ServerContext* context, const pb::StepCall* call, pb::StepResult* response) override {
    return WithEngine(context, call->engine_id(), [&](Engine& engine) {
      *response = engine.Step(Op::kPrefill, call->request());
      if (call->with_metrics()) *response->mutable_metrics() = engine.Metrics();
    });
  }

  grpc::Status Decode(grpc::ServerContext* context, const pb::StepCall* call, pb::StepResult* response) override {
    return WithEngine(context, call->engine_id(), [&](Engine& engine) {
      *response = engine.Step(Op::kDecode, call->request());
      if (call->with_metrics()) *response->mutable_metrics() = engine.Metrics();
    });
  }

  grpc::Status Cancel(grpc::ServerContext* context, const pb::CancelCall* call, pb::StructuredStatus* response) override {
    return WithEngine(context, call->engine_id(), [&](Engine& engine) {
      *response = engine.Cancel(call->session_id(), EpochOf(*call));
      if (call->with_metrics()) *response->mutable_metrics() = engine.Metrics();
    });
  }

  grpc::Status Release(grpc::ServerContext* context, const pb::ReleaseCall* call, pb::StructuredStatus* response) override {
    return WithEngine(context, call->engine_id(), [&](Engine& engine) {
      *response = engine.Release(call->session_id());
      if (call->with_metrics()) *response->mutable_metrics() = engine.Metrics();
    });
  }

  grpc::Status Health(grpc::ServerContext* context, const pb::EngineRef* ref, pb::HealthResult* response) override {
    return WithEngine(context, ref->engine_id(), [&](Engine& engine) { *response = engine.Health(); });
  }

  grpc::Status Metrics(grpc::ServerContext* context, const pb::EngineRef* ref, pb::MetricsResult* response) override {
    return WithEngine(context, ref->engine_id(), [&](Engine& engine) { *response = engine.Metrics(); });
  }

  // No fault is supported natively (supported_faults is empty): every kind is UNIMPLEMENTED.
  grpc::Status InjectFault(grpc::ServerContext* context, const pb::InjectFaultCall* call, pb::StructuredStatus* response) override {
    return WithEngine(context, call->engine_id(), [&](Engine& engine) {
      *response = Status(pb::STATUS_CODE_UNIMPLEMENTED, "no fault is supported natively ('" + call->fault().kind() + "' included)");
      if (call->with_metrics()) *response->mutable_metrics() = engine.Metrics();
    });
  }

 private:
  pb::Answer AnswerTo(const pb::Call& call) {
    const std::string& rpc = call.rpc();
    if (rpc == "NewEngine") return Streamed(call, &Service::NewEngine);
    if (rpc == "CloseEngine") return Streamed(call, &Service::CloseEngine);
    if (rpc == "Load") return Streamed(call, &Service::Load);
    if (rpc == "Capabilities") return Streamed(call, &Service::Capabilities);
    if (rpc == "Prefill") return Streamed(call, &Service::Prefill);
    if (rpc == "Decode") return Streamed(call, &Service::Decode);
    if (rpc == "Cancel") return Streamed(call, &Service::Cancel);
    if (rpc == "Release") return Streamed(call, &Service::Release);
    if (rpc == "Health") return Streamed(call, &Service::Health);
    if (rpc == "Metrics") return Streamed(call, &Service::Metrics);
    if (rpc == "InjectFault") return Streamed(call, &Service::InjectFault);
    pb::Answer answer;
    answer.set_status_code(grpc::StatusCode::UNIMPLEMENTED);
    answer.set_details("Calls cannot carry a call of '" + rpc + "'");
    return answer;
  }

  // One call of a Calls stream, run by the unary method: no ServerContext (WithEngine keeps an
  // engine's exception type for the answer's trailing metadata instead).
  template <class Request, class Response>
  pb::Answer Streamed(const pb::Call& call,
                      grpc::Status (Service::*method)(grpc::ServerContext*, const Request*, Response*)) {
    pb::Answer answer;
    Request request;
    if (!request.ParseFromString(call.request())) {
      answer.set_status_code(grpc::StatusCode::INVALID_ARGUMENT);
      answer.set_details("cannot decode the " + call.rpc() + " request: its bytes are not a " +
                         Request::descriptor()->full_name() + " message");
      return answer;
    }
    Response response;
    streamed_exception_type.clear();
    grpc::Status status = (this->*method)(nullptr, &request, &response);
    if (status.ok()) {
      response.SerializeToString(answer.mutable_response());
    } else {
      answer.set_status_code(status.error_code());
      answer.set_details(status.error_message());
      if (!streamed_exception_type.empty())
        (*answer.mutable_trailing_metadata())["shardkit-exception-type"] = streamed_exception_type;
    }
    return answer;
  }

  // Runs `body` on the named engine under its own lock; an unknown id is gRPC NOT_FOUND.
  // The shared_ptr keeps the engine alive if another thread closes it meanwhile. An exception
  // out of the engine (a bug, std::bad_alloc under --worker-memory) is answered as the proto
  // asks: INTERNAL, details "TypeName: message", and the type in the trailing metadata
  // "shardkit-exception-type"; the kit then names it (unexplained exception, worker memory).
  // Left to gRPC, it would be UNKNOWN "Unexpected error in RPC handling", a garbage answer.
  template <class Body>
  grpc::Status WithEngine(grpc::ServerContext* context, uint64_t id, Body body) {
    std::shared_ptr<Engine> engine;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto found = engines_.find(id);
      if (found != engines_.end()) engine = found->second;
    }
    if (!engine)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no engine " + std::to_string(id) +
                                                           " (closed, never built, or dropped past " +
                                                           std::to_string(kMaxEngines) + " live engines)");
    std::lock_guard<std::mutex> lock(engine->mu);
    try {
      body(*engine);
    } catch (const std::exception& error) {
      std::string type = TypeName(error);
      std::fprintf(stderr, "shard_worker: engine %llu raised %s: %s\n", static_cast<unsigned long long>(id),
                   type.c_str(), error.what());
      std::fflush(stderr);
      if (context != nullptr) context->AddTrailingMetadata("shardkit-exception-type", type);
      else streamed_exception_type = type;  // a call of a Calls stream: its answer carries it
      return grpc::Status(grpc::StatusCode::INTERNAL, type + ": " + error.what());
    }
    return grpc::Status::OK;
  }

  static std::string TypeName(const std::exception& error) {
    int status = 0;
    char* name = abi::__cxa_demangle(typeid(error).name(), nullptr, nullptr, &status);
    std::string text = status == 0 && name != nullptr ? name : typeid(error).name();
    std::free(name);
    return text;
  }

  // The exception type of the engine call a Calls stream's thread ran last (see Streamed).
  static thread_local std::string streamed_exception_type;

  const std::string server_id_;
  std::mutex mu_;  // guards engines_ and next_id_
  std::map<uint64_t, std::shared_ptr<Engine>> engines_;
  uint64_t next_id_ = 1;
};

thread_local std::string Service::streamed_exception_type;

// --- the process: listen, then wait for stdin EOF or a signal ---------------------------------

std::mutex stop_mu;
std::condition_variable stop_cv;
bool stop_requested = false;

void RequestStop() {
  std::lock_guard<std::mutex> lock(stop_mu);
  stop_requested = true;
  stop_cv.notify_all();
}

}  // namespace

int main(int argc, char** argv) {
  std::string listen = "127.0.0.1:0";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--listen" && i + 1 < argc) listen = argv[++i];
    else if (arg.rfind("--listen=", 0) == 0) listen = arg.substr(9);
    else {
      std::fprintf(stderr, "usage: %s --listen unix:/PATH.sock | HOST:PORT\n", argv[0]);
      return 2;
    }
  }
  if (listen.rfind("grpc://", 0) == 0) listen = listen.substr(7);  // the kit's spelling of HOST:PORT

  // Block SIGTERM and SIGINT before gRPC starts its threads, so they all inherit the mask and
  // the signals wait for sigwait below: shutting gRPC down is not async-signal-safe.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // Identifies this process to the kit (a restarted worker on the same address gets another
  // id); it is never part of an engine's answer, so reading the clock here is harmless.
  auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  Service service("shard_worker-" + std::to_string(getpid()) + "-" + std::to_string(now));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(256 << 20);  // as the kit's own limit
  builder.SetMaxSendMessageSize(256 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "shard_worker: cannot listen on %s\n", listen.c_str());
    return 2;
  }
  std::string url = listen.rfind("unix:", 0) == 0
                        ? listen
                        : "grpc://" + listen.substr(0, listen.rfind(':')) + ":" + std::to_string(port);
  std::printf("listening on %s\n", url.c_str());
  std::fflush(stdout);

  // Whoever started us holds our stdin; when it dies (even by kill -9) we read end of file.
  std::thread([] {
    char buffer[256];
    while (true) {
      ssize_t n = read(STDIN_FILENO, buffer, sizeof buffer);
      if (n == 0 || (n < 0 && errno != EINTR)) break;
    }
    RequestStop();
  }).detach();
  std::thread([stop_signals] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    RequestStop();
  }).detach();

  {
    std::unique_lock<std::mutex> lock(stop_mu);
    stop_cv.wait(lock, [] { return stop_requested; });
  }
  // Shutdown waits for every call in flight to return, and a hung call never does: whatever
  // is left after two seconds, leave anyway (stdin closed means nobody will ask us again).
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::_Exit(0);
  }).detach();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  std::fflush(stdout);
  // The watcher threads may still be blocked in read() or sigwait(): leave without running
  // global destructors under them.
  std::_Exit(0);
}
