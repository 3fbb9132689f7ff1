#pragma once
/// libcurl's handles, owned: an easy handle and a header list each free
/// themselves, so that no early return of a request can leak one.

#include <curl/curl.h>

#include <memory>
#include <string>

namespace cfmo::oci {

struct CurlEasyCleanup {
  void operator()(CURL* curl) const { curl_easy_cleanup(curl); }
};
/// An easy handle (curl_easy_init); null when libcurl could not make one.
using CurlEasy = std::unique_ptr<CURL, CurlEasyCleanup>;

inline CurlEasy make_curl_easy() { return CurlEasy(curl_easy_init()); }

/// A header list (curl_slist), freed with the object.
class CurlHeaders {
 public:
  CurlHeaders() = default;
  ~CurlHeaders() { curl_slist_free_all(list_); }
  CurlHeaders(const CurlHeaders&) = delete;
  CurlHeaders& operator=(const CurlHeaders&) = delete;

  void append(const std::string& header) {
    if (curl_slist* longer = curl_slist_append(list_, header.c_str()); longer != nullptr) list_ = longer;
  }
  curl_slist* get() const { return list_; }

 private:
  curl_slist* list_ = nullptr;
};

}  // namespace cfmo::oci
