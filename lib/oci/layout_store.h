#pragma once
/// The image-layout store a pull writes into: an OCI image layout
/// (oci-layout, blobs/sha256/, index.json) whose blobs arrive first and
/// whose manifest and index.json go in last, so that a layout never names a
/// blob it lacks (readers such as skopeo and umoci see a complete image or
/// none). The pull's state file beside it is pull_state.h's.

#include "core/error.h"
#include "oci/manifest.h"

#include <filesystem>
#include <string>

namespace cfmo::oci {

/// Creates DIR/blobs/sha256/; an oci-layout already there must be version 1.0.0 (else kInput).
Status prepare_layout(const std::filesystem::path& dir);

/// The manifest goes in last, so a layout never names blobs it lacks: the
/// manifest's blob (a Docker schema 2 one as its OCI conversion, which
/// `layout_manifest` then describes), oci-layout, and index.json naming it `tag`.
Status finish_layout(const std::filesystem::path& dir, const std::string& manifest_body, const Descriptor& manifest,
                     const std::string& tag, Descriptor& layout_manifest);

/// DIR/blobs/sha256/<hex> made a symlink to the blob in the memory store
/// (atomically: a reader sees the old entry or the link, never neither).
Status link_blob(const std::filesystem::path& dir, const std::filesystem::path& target, const std::string& digest);

}  // namespace cfmo::oci
