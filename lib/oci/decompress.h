#pragma once
/// Streaming decompression of layer blobs, for the unpacker: gzip through
/// ISA-L's igzip where the build found it (zlib otherwise), zstd, or none.
/// A Decoder pulls compressed chunks from a ByteSource and hands out
/// decompressed blocks; it never holds more than one input chunk and one
/// output block (plus the codec's window).

#include "core/error.h"
#include "oci/unpack.h"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace cfmo::oci {

/// Compressed bytes in order. next() returns the next chunk, valid until the
/// following call, or an empty view at the end; an error stops the stream.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual Result<std::string_view> next() = 0;
};

/// Decompressed bytes. read() returns the next block (valid until the
/// following call), an empty view at the end of the stream, or kInput for a
/// stream that is corrupt, truncated or followed by other data.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual Result<std::string_view> read() = 0;
  int64_t compressed_bytes() const { return compressed_; }

 protected:
  int64_t compressed_ = 0;  ///< taken from the source so far
};

/// `what` names the layer in errors.
std::unique_ptr<Decoder> make_decoder(Compression compression, ByteSource& source, std::string what);

/// A gzip decoder: igzip where built in, zlib when `use_zlib` or without ISA-L.
std::unique_ptr<Decoder> make_gzip_decoder(ByteSource& source, std::string what, bool use_zlib);

/// Runs `inner` on a thread of its own, `blocks` decompressed blocks ahead of
/// the reader (each copied into one of `blocks` buffers), so decompression and
/// the reader's work overlap. `inner`'s source must end or fail on its own
/// when the reader stops early (the wrapper's destructor waits for it).
std::unique_ptr<Decoder> make_prefetching(std::unique_ptr<Decoder> inner, size_t blocks = 4);

/// The gzip inflater built in: "igzip (ISA-L)" or "zlib".
const char* gzip_implementation();

}  // namespace cfmo::oci
