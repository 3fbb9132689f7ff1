#include "ckpt/safetensors.h"

#include "core/atomic_file.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace cfmo::ckpt {
namespace {

Error corrupt(const std::string& source, std::string_view what) {
  return make_error(ErrorKind::kInput, "'{}': {}", source, what);
}

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

}  // namespace

size_t dtype_size(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

int64_t SafetensorsFile::Entry::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Status write_safetensors(const std::filesystem::path& path, std::span<const TensorRef> tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& t : tensors) {
    const size_t width = dtype_size(t.dtype);
    int64_t elements = 1;
    for (int64_t d : t.shape) elements *= d;
    if (width == 0 || t.bytes.size() != static_cast<size_t>(elements) * width) {
      return make_error(ErrorKind::kInternal, "'{}': tensor '{}' has {} bytes for {} {}", path.string(), t.name,
                        t.bytes.size(), t.dtype, shape_string(t.shape));
    }
    // A repeated name would replace the header entry but still write the bytes, leaving a hole
    // that no reader accepts; "__metadata__" is the format's own key.
    if (t.name == "__metadata__" || header.contains(t.name)) {
      return make_error(ErrorKind::kInternal, "'{}': tensor name '{}' is reserved or repeated", path.string(), t.name);
    }
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::type_error& e) {  // a name or metadata value that is not UTF-8
    return make_error(ErrorKind::kInternal, "'{}': cannot write the header: {}", path.string(), e.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  char prefix[8];
  std::memcpy(prefix, &length, 8);

  CFMO_ASSIGN_OR_RETURN(auto file, AtomicFile::create(path));
  CFMO_TRY(file.write(std::string_view(prefix, 8)));
  CFMO_TRY(file.write(text));
  for (const auto& t : tensors) CFMO_TRY(file.write(t.bytes));
  return file.commit();
}

Result<SafetensorsFile> SafetensorsFile::read(const std::filesystem::path& path, SafetensorsLimits limits) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return make_error(ErrorKind::kInput, "'{}': no such file", path.string());
  }
  CFMO_ASSIGN_OR_RETURN(std::string bytes, read_file(path));
  return parse(std::move(bytes), path.string(), limits);
}

Result<SafetensorsFile> SafetensorsFile::parse(std::string bytes, const std::string& source, SafetensorsLimits limits) {
  SafetensorsFile file;
  file.source_ = source;
  if (bytes.size() < 8) return corrupt(source, "too short for a safetensors header");
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  if (header_length > limits.max_header_bytes) {
    return corrupt(source,
                   fmt::format("header of {} bytes exceeds the limit of {}", header_length, limits.max_header_bytes));
  }
  if (header_length > bytes.size() - 8) return corrupt(source, "truncated header");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_length));
  } catch (const nlohmann::json::exception& e) {
    return corrupt(source, fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!header.is_object()) return corrupt(source, "header is not a JSON object");
  file.data_start_ = 8 + header_length;
  const size_t data_size = bytes.size() - file.data_start_;

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return corrupt(source, "__metadata__ is not an object");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) return corrupt(source, fmt::format("__metadata__ '{}' is not a string", key));
        file.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    // A named copy: Clang before 16 cannot capture a structured binding (the fuzz targets build with Clang).
    const std::string& tensor_name = name;
    auto bad = [&](std::string_view why) { return corrupt(source, fmt::format("tensor '{}': {}", tensor_name, why)); };
    if (!value.is_object()) return bad("entry is not an object");
    Entry entry;
    entry.name = name;
    const auto dtype = value.find("dtype");
    const auto shape = value.find("shape");
    const auto offsets = value.find("data_offsets");
    if (dtype == value.end() || !dtype->is_string()) return bad("missing dtype");
    entry.dtype = dtype->get<std::string>();
    const size_t width = dtype_size(entry.dtype);
    if (width == 0) return bad(fmt::format("unknown dtype '{}'", entry.dtype));
    if (shape == value.end() || !shape->is_array()) return bad("missing shape");
    uint64_t elements = 1;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) return bad("shape has a non-integer or negative dimension");
      const auto dim = d.get<uint64_t>();
      // Checked apart from the product: next to a zero dimension the product stays 0.
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return bad("shape overflows");
      if (dim != 0 && elements > std::numeric_limits<uint64_t>::max() / dim / width) return bad("shape overflows");
      elements *= dim;
      entry.shape.push_back(static_cast<int64_t>(dim));
    }
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned()) {
      return bad("data_offsets must be two unsigned integers");
    }
    const auto begin = (*offsets)[0].get<uint64_t>();
    const auto end = (*offsets)[1].get<uint64_t>();
    if (begin > end || end > data_size) return bad("data_offsets point past the end of the file");
    if (end - begin != elements * width) {
      return bad(fmt::format("{} bytes for {} {}", end - begin, entry.dtype, shape_string(entry.shape)));
    }
    entry.begin = begin;
    entry.end = end;
    file.entries_.push_back(std::move(entry));
  }
  std::sort(file.entries_.begin(), file.entries_.end(),
            [](const Entry& a, const Entry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  size_t expected = 0;
  for (const auto& e : file.entries_) {
    if (e.begin < expected) return corrupt(source, fmt::format("tensor '{}' overlaps the previous one", e.name));
    if (e.begin > expected) return corrupt(source, fmt::format("hole in the data before tensor '{}'", e.name));
    expected = e.end;
  }
  if (expected != data_size) return corrupt(source, "bytes after the last tensor");
  file.contents_ = std::move(bytes);
  return file;
}

const SafetensorsFile::Entry* SafetensorsFile::find(std::string_view name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::span<const std::byte> SafetensorsFile::bytes(const Entry& entry) const {
  const auto* base = reinterpret_cast<const std::byte*>(contents_.data()) + data_start_;
  return {base + entry.begin, entry.end - entry.begin};
}

Status SafetensorsFile::read_f32(std::string_view name, const std::vector<int64_t>& shape, std::span<float> out) const {
  const Entry* e = find(name);
  if (e == nullptr) return corrupt(source_, fmt::format("no tensor '{}'", name));
  if (e->dtype != "F32") return corrupt(source_, fmt::format("tensor '{}' is {}, expected F32", name, e->dtype));
  if (e->shape != shape) {
    return corrupt(source_, fmt::format("tensor '{}' has shape {}, expected {}", name, shape_string(e->shape),
                                        shape_string(shape)));
  }
  auto data = bytes(*e);
  if (data.size() != out.size_bytes()) return corrupt(source_, fmt::format("tensor '{}' has the wrong size", name));
  // memcpy with a null pointer is undefined even for 0 bytes, and an empty span's data() may be null.
  if (!data.empty()) std::memcpy(out.data(), data.data(), data.size());
  return {};
}

}  // namespace cfmo::ckpt
