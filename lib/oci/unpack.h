#pragma once
/// Unpacking image layers into a directory tree: a layer's compressed bytes
/// (gzip through ISA-L's igzip or zlib, zstd, or none) are decompressed and
/// read as a tar with libarchive, and every entry is written by this module
/// itself, confined to the root: `..`, absolute paths, writes through a
/// symlink (one planted by an earlier entry or layer included) and hard links
/// to outside are kInput errors naming the layer and the entry. OCI whiteouts
/// are applied, turned into overlayfs whiteouts, or kept (WhiteoutMode).
/// Memory is bounded (a few MiB per unpacker) whatever the layer's size.

#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace cfmo::oci {

enum class Compression { kNone, kGzip, kZstd };

/// From a layer media type (OCI and Docker; tar, tar+gzip, tar+zstd, their
/// nondistributable forms); an unknown or non-layer type is kInput.
Result<Compression> layer_compression(const std::string& media_type);

/// "none", "gzip", "zstd".
const char* compression_name(Compression compression);

/// How OCI whiteouts are written: kApply deletes in a merged rootfs (.wh.NAME
/// removes NAME below, .wh..wh..opq clears the directory of lower content);
/// kOverlay writes each layer into its own directory with overlayfs whiteouts
/// (0:0 character devices, trusted.overlay.opaque=y; needs root); kKeep writes
/// each layer into its own directory and keeps the .wh. files as they are.
enum class WhiteoutMode { kApply, kOverlay, kKeep };

/// Whether this process may create device nodes and change owners (euid 0).
bool running_as_root();

struct UnpackOptions {
  WhiteoutMode whiteouts = WhiteoutMode::kApply;
  bool devices = running_as_root();  ///< create device nodes; else they are skipped and counted
  bool owners = running_as_root();   ///< chown entries to the tar's uid/gid
  bool xattrs = true;                ///< set the tar's extended attributes where allowed (else skipped)
  size_t buffer_bytes = 4u << 20;    ///< the bound on compressed bytes queued between write() and extraction
};

struct UnpackStats {
  int64_t compressed_bytes = 0;
  int64_t uncompressed_bytes = 0;  ///< the tar stream's size
  int64_t entries = 0;             ///< tar entries read, whiteouts included
  int64_t skipped_devices = 0;     ///< device nodes (and sockets) not created
  int64_t skipped_xattrs = 0;      ///< extended attributes not set (not allowed, unsupported, trusted.overlay.*)
};

/// Streams one layer into `root` while it downloads: write() takes compressed
/// bytes in order (from one thread); decompression and extraction run on a
/// thread of the unpacker's own behind a bounded buffer. `root` must exist;
/// `what` names the layer in errors ("layer sha256:1234… (2)").
class LayerUnpacker {
 public:
  static Result<std::unique_ptr<LayerUnpacker>> start(const std::filesystem::path& root, Compression compression,
                                                      const UnpackOptions& options, std::string what);
  ~LayerUnpacker();  ///< aborts when neither finish() nor abort() was called
  LayerUnpacker(const LayerUnpacker&) = delete;
  LayerUnpacker& operator=(const LayerUnpacker&) = delete;

  /// Blocks while the bounded buffer is full; returns the extraction's error
  /// if one happened (later calls return it again).
  Status write(std::string_view compressed);
  /// The end of the blob: waits for the extraction to end. A stream that is
  /// truncated, corrupt, or followed by garbage is kInput.
  Result<UnpackStats> finish();
  /// Stops the extraction and waits for its thread (e.g. after a digest
  /// mismatch or a restart); what was written so far stays in `root`.
  void abort();

  struct Impl;

 private:
  explicit LayerUnpacker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The same from a complete blob file (cold layers fetched later, re-unpacking),
/// on the calling thread.
Result<UnpackStats> unpack_layer_file(const std::filesystem::path& blob, const std::filesystem::path& root,
                                      Compression compression, const UnpackOptions& options, const std::string& what);

namespace detail {
/// Tests only: resolve paths one O_NOFOLLOW component at a time, as on a
/// kernel without openat2 (5.6+).
void use_openat2(bool enabled);
}  // namespace detail

}  // namespace cfmo::oci
