#include "oci/decompress.h"

#include <zlib.h>
#include <zstd.h>

#include <pthread.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#ifdef CFMO_HAVE_ISAL
#include <isa-l/igzip_lib.h>
#endif

namespace cfmo::oci {
namespace {

constexpr size_t kOutBlock = 1u << 20;

/// The bytes as they come (an uncompressed tar layer).
class PlainDecoder : public Decoder {
 public:
  explicit PlainDecoder(ByteSource& source) : source_(source) {}
  Result<std::string_view> read() override {
    CFMO_ASSIGN_OR_RETURN(const auto chunk, source_.next());
    compressed_ += static_cast<int64_t>(chunk.size());
    return chunk;
  }

 private:
  ByteSource& source_;
};

/// What gzip decoders share: input handling and the rules for what may follow
/// a member (another member, or nothing: Go's and zlib's readers agree).
class GzipDecoderBase : public Decoder {
 public:
  GzipDecoderBase(ByteSource& source, std::string what) : source_(source), what_(std::move(what)), out_(kOutBlock) {}

  Result<std::string_view> read() override {
    while (true) {
      if (input().empty() && !source_done_) {
        CFMO_ASSIGN_OR_RETURN(in_, source_.next());
        compressed_ += static_cast<int64_t>(in_.size());
        if (in_.empty()) source_done_ = true;
      }
      if (between_members_) {
        const std::string_view head = input();
        if (head.empty()) {
          if (source_done_) return std::string_view{};
          continue;
        }
        // Another member must start with the gzip magic.
        if (static_cast<unsigned char>(head[0]) != 0x1f ||
            (head.size() > 1 && static_cast<unsigned char>(head[1]) != 0x8b)) {
          return make_error(ErrorKind::kInput, "{}: data after the end of the gzip stream", what_);
        }
        between_members_ = false;
        restart();
      }
      if (input().empty() && source_done_ && !flushing_) {
        return make_error(ErrorKind::kInput, "{}: truncated gzip stream", what_);
      }
      size_t produced = 0;
      CFMO_TRY(step(produced));
      // A full block may leave output inside the inflater, to flush without new input.
      flushing_ = produced == out_.size();
      if (produced > 0) return std::string_view(out_.data(), produced);
    }
  }

 protected:
  /// Inflates from input() into out_, setting `produced`, consuming what it
  /// used; at a member's end it sets between_members_ and gives back (through
  /// give_back) any input it had read past the end.
  virtual Status step(size_t& produced) = 0;
  virtual void restart() = 0;

  /// The bytes to inflate next: those given back first, then the source's chunk.
  std::string_view input() const {
    return carry_pos_ < carry_.size() ? std::string_view(carry_).substr(carry_pos_) : in_;
  }
  void consume(size_t n) {
    if (carry_pos_ < carry_.size()) {
      carry_pos_ += n;
      if (carry_pos_ == carry_.size()) {
        carry_.clear();
        carry_pos_ = 0;
      }
    } else {
      in_.remove_prefix(n);
    }
  }
  /// Puts bytes back in front of the input.
  void give_back(std::string bytes) {
    if (bytes.empty()) return;
    bytes.append(carry_, carry_pos_, std::string::npos);
    carry_ = std::move(bytes);
    carry_pos_ = 0;
  }

  ByteSource& source_;
  std::string what_;
  std::vector<char> out_;
  bool between_members_ = false;

 private:
  std::string_view in_;
  std::string carry_;
  size_t carry_pos_ = 0;
  bool source_done_ = false;
  bool flushing_ = false;
};

#ifdef CFMO_HAVE_ISAL
class IgzipDecoder : public GzipDecoderBase {
 public:
  IgzipDecoder(ByteSource& source, std::string what)
      : GzipDecoderBase(source, std::move(what)), state_(std::make_unique<inflate_state>()) {
    isal_inflate_init(state_.get());
    state_->crc_flag = ISAL_GZIP;
  }

 protected:
  void restart() override {
    isal_inflate_reset(state_.get());
    state_->crc_flag = ISAL_GZIP;
  }

  Status step(size_t& produced) override {
    const std::string_view in = input();
    state_->next_in = reinterpret_cast<uint8_t*>(const_cast<char*>(in.data()));
    state_->avail_in = static_cast<uint32_t>(in.size());
    state_->next_out = reinterpret_cast<uint8_t*>(out_.data());
    state_->avail_out = static_cast<uint32_t>(out_.size());
    const int rc = isal_inflate(state_.get());
    consume(in.size() - state_->avail_in);
    produced = out_.size() - state_->avail_out;
    if (rc < 0) return make_error(ErrorKind::kInput, "{}: corrupt gzip stream ({})", what_, describe(rc));
    if (state_->block_state == ISAL_BLOCK_FINISH) {
      // igzip may hold input bytes past the trailer in its bit buffer.
      std::string rest;
      const int buffered = state_->read_in_length / 8;
      for (int i = 0; i < buffered; ++i) rest.push_back(static_cast<char>((state_->read_in >> (8 * i)) & 0xff));
      state_->read_in = 0;
      state_->read_in_length = 0;
      give_back(std::move(rest));
      between_members_ = true;
    }
    return {};
  }

 private:
  static const char* describe(int rc) {
    switch (rc) {
      case ISAL_INVALID_BLOCK:
        return "invalid deflate block";
      case ISAL_INVALID_SYMBOL:
        return "invalid deflate symbol";
      case ISAL_INVALID_LOOKBACK:
        return "invalid lookback distance";
      case ISAL_INVALID_WRAPPER:
        return "not a gzip header";
      case ISAL_UNSUPPORTED_METHOD:
        return "not deflate";
      case ISAL_INCORRECT_CHECKSUM:
        return "CRC mismatch";
      default:
        return "inflate error";
    }
  }

  std::unique_ptr<inflate_state> state_;
};
#endif

class ZlibDecoder : public GzipDecoderBase {
 public:
  ZlibDecoder(ByteSource& source, std::string what) : GzipDecoderBase(source, std::move(what)) {
    z_ = {};
    ok_ = inflateInit2(&z_, 16 + MAX_WBITS) == Z_OK;
  }
  ~ZlibDecoder() override {
    if (ok_) inflateEnd(&z_);
  }

 protected:
  void restart() override { inflateReset(&z_); }

  Status step(size_t& produced) override {
    if (!ok_) return make_error(ErrorKind::kInternal, "{}: zlib did not initialise", what_);
    const std::string_view in = input();
    z_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
    z_.avail_in = static_cast<uInt>(in.size());
    z_.next_out = reinterpret_cast<Bytef*>(out_.data());
    z_.avail_out = static_cast<uInt>(out_.size());
    const int rc = inflate(&z_, Z_NO_FLUSH);
    consume(in.size() - z_.avail_in);
    produced = out_.size() - z_.avail_out;
    if (rc == Z_STREAM_END) {
      between_members_ = true;  // zlib stops at the trailer: what follows is still in the input
      return {};
    }
    if (rc == Z_OK || rc == Z_BUF_ERROR) return {};
    return make_error(ErrorKind::kInput, "{}: corrupt gzip stream ({})", what_, z_.msg != nullptr ? z_.msg : "zlib");
  }

 private:
  z_stream z_;
  bool ok_ = false;
};

class ZstdDecoder : public Decoder {
 public:
  ZstdDecoder(ByteSource& source, std::string what)
      : source_(source), what_(std::move(what)), dctx_(ZSTD_createDCtx()), out_(ZSTD_DStreamOutSize()) {
    // zstd's default window cap (128 MiB) bounds memory against --long streams.
    ZSTD_DCtx_setParameter(dctx_, ZSTD_d_windowLogMax, 27);
  }
  ~ZstdDecoder() override { ZSTD_freeDCtx(dctx_); }

  Result<std::string_view> read() override {
    while (true) {
      if (in_.pos == in_.size && !source_done_) {
        CFMO_ASSIGN_OR_RETURN(const auto chunk, source_.next());
        compressed_ += static_cast<int64_t>(chunk.size());
        in_ = {chunk.data(), chunk.size(), 0};
        if (chunk.empty()) source_done_ = true;
      }
      if (in_.pos == in_.size && source_done_ && !flushing_) {
        if (!seen_input_) return make_error(ErrorKind::kInput, "{}: empty zstd stream", what_);
        if (pending_ != 0) return make_error(ErrorKind::kInput, "{}: truncated zstd stream", what_);
        return std::string_view{};
      }
      ZSTD_outBuffer out{out_.data(), out_.size(), 0};
      const size_t rc = ZSTD_decompressStream(dctx_, &out, &in_);
      if (ZSTD_isError(rc)) {
        return make_error(ErrorKind::kInput, "{}: corrupt zstd stream ({})", what_, ZSTD_getErrorName(rc));
      }
      if (in_.size > 0) seen_input_ = true;
      pending_ = rc;
      // A full output buffer may leave more to flush without new input.
      flushing_ = out.pos == out.size;
      if (out.pos > 0) return std::string_view(out_.data(), out.pos);
    }
  }

 private:
  ByteSource& source_;
  std::string what_;
  ZSTD_DCtx* dctx_;
  std::vector<char> out_;
  ZSTD_inBuffer in_{nullptr, 0, 0};
  bool source_done_ = false;
  bool seen_input_ = false;
  bool flushing_ = false;
  size_t pending_ = 0;
};

/// Decompresses ahead on its own thread into a few buffers of its own.
class PrefetchDecoder : public Decoder {
 public:
  PrefetchDecoder(std::unique_ptr<Decoder> inner, size_t blocks) : inner_(std::move(inner)) {
    for (size_t i = 0; i < std::max<size_t>(blocks, 2); ++i) free_.emplace_back();
    thread_ = std::thread([this] { produce(); });
  }
  ~PrefetchDecoder() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  Result<std::string_view> read() override {
    std::unique_lock lock(mutex_);
    if (reading_) {
      free_.push_back(std::move(*reading_));
      reading_.reset();
      changed_.notify_all();
    }
    changed_.wait(lock, [&] { return !ready_.empty() || finished_; });
    if (ready_.empty()) {
      compressed_ = inner_compressed_;
      if (error_) return *error_;
      return std::string_view{};
    }
    reading_ = std::move(ready_.front());
    ready_.pop_front();
    changed_.notify_all();
    return std::string_view(*reading_);
  }

 private:
  void produce() {
    pthread_setname_np(pthread_self(), "cfmo-inflate");
    while (true) {
      auto block = inner_->read();
      std::unique_lock lock(mutex_);
      if (!block || block->empty()) {
        if (!block) error_ = std::move(block).error();
        inner_compressed_ = inner_->compressed_bytes();
        finished_ = true;
        changed_.notify_all();
        return;
      }
      changed_.wait(lock, [&] { return !free_.empty() || stop_; });
      if (stop_) return;
      std::string buffer = std::move(free_.front());
      free_.pop_front();
      lock.unlock();
      buffer.assign(block->data(), block->size());
      lock.lock();
      ready_.push_back(std::move(buffer));
      changed_.notify_all();
    }
  }

  std::unique_ptr<Decoder> inner_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::string> free_;
  std::deque<std::string> ready_;
  std::optional<std::string> reading_;  ///< the block the reader holds
  std::optional<Error> error_;
  int64_t inner_compressed_ = 0;
  bool finished_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Decoder> make_gzip_decoder(ByteSource& source, std::string what, bool use_zlib) {
#ifdef CFMO_HAVE_ISAL
  if (!use_zlib) return std::make_unique<IgzipDecoder>(source, std::move(what));
#endif
  (void)use_zlib;
  return std::make_unique<ZlibDecoder>(source, std::move(what));
}

std::unique_ptr<Decoder> make_decoder(Compression compression, ByteSource& source, std::string what) {
  switch (compression) {
    case Compression::kNone:
      return std::make_unique<PlainDecoder>(source);
    case Compression::kZstd:
      return std::make_unique<ZstdDecoder>(source, std::move(what));
    case Compression::kGzip:
      break;
  }
  return make_gzip_decoder(source, std::move(what), false);
}

std::unique_ptr<Decoder> make_prefetching(std::unique_ptr<Decoder> inner, size_t blocks) {
  return std::make_unique<PrefetchDecoder>(std::move(inner), blocks);
}

const char* gzip_implementation() {
#ifdef CFMO_HAVE_ISAL
  return "igzip (ISA-L)";
#else
  return "zlib";
#endif
}

}  // namespace cfmo::oci
