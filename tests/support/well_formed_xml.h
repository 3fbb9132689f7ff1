#pragma once
// A small well-formedness check for the SVG cfmo-diverge writes: one root
// element, every tag closed in order, quoted attributes, known entities and
// no stray '<' or '&' in text. Not a validating parser; enough to catch a
// broken writer without an XML library in the test dependencies.

#include <cctype>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::testing {

/// Empty when `text` is well-formed; otherwise what is wrong and where.
inline std::string xml_problem(std::string_view text) {
  std::vector<std::string> open;
  size_t i = 0;
  int roots = 0;
  auto at = [&](size_t pos) { return " at byte " + std::to_string(pos); };
  auto check_text = [&](std::string_view t, size_t base) -> std::string {
    for (size_t k = 0; k < t.size(); ++k) {
      if (t[k] == '<') return "'<' in text" + at(base + k);
      if (t[k] == '&') {
        const size_t semi = t.find(';', k);
        if (semi == std::string_view::npos) return "unterminated entity" + at(base + k);
        const std::string_view entity = t.substr(k + 1, semi - k - 1);
        if (entity != "amp" && entity != "lt" && entity != "gt" && entity != "quot" && entity != "apos" &&
            !(entity.size() > 1 && entity[0] == '#')) {
          return "unknown entity &" + std::string(entity) + ";" + at(base + k);
        }
      }
    }
    return {};
  };
  while (i < text.size()) {
    const size_t lt = text.find('<', i);
    const std::string_view between = text.substr(i, (lt == std::string_view::npos ? text.size() : lt) - i);
    if (auto p = check_text(between, i); !p.empty()) return p;
    if (open.empty() && between.find_first_not_of(" \t\r\n") != std::string_view::npos) {
      return "text outside the root element" + at(i);
    }
    if (lt == std::string_view::npos) break;
    if (text.substr(lt, 5) == "<?xml") {
      const size_t end = text.find("?>", lt);
      if (end == std::string_view::npos || lt != 0) return "bad XML declaration" + at(lt);
      i = end + 2;
      continue;
    }
    if (text.substr(lt, 4) == "<!--") {
      const size_t end = text.find("-->", lt);
      if (end == std::string_view::npos) return "unterminated comment" + at(lt);
      i = end + 3;
      continue;
    }
    // A tag: quoted attribute values may hold '>'.
    size_t gt = lt + 1;
    char quote = 0;
    for (; gt < text.size(); ++gt) {
      if (quote != 0) {
        if (text[gt] == quote)
          quote = 0;
        else if (text[gt] == '<')
          return "'<' in an attribute value" + at(gt);
      } else if (text[gt] == '"' || text[gt] == '\'') {
        quote = text[gt];
      } else if (text[gt] == '>') {
        break;
      }
    }
    if (gt >= text.size()) return "unterminated tag" + at(lt);
    std::string_view tag = text.substr(lt + 1, gt - lt - 1);
    const bool closing = !tag.empty() && tag[0] == '/';
    const bool self_closing = !tag.empty() && tag.back() == '/';
    if (closing) tag.remove_prefix(1);
    if (self_closing) tag.remove_suffix(1);
    size_t name_end = 0;
    while (name_end < tag.size() && (std::isalnum(static_cast<unsigned char>(tag[name_end])) != 0 ||
                                     tag[name_end] == '-' || tag[name_end] == ':' || tag[name_end] == '_')) {
      ++name_end;
    }
    const std::string name(tag.substr(0, name_end));
    if (name.empty()) return "tag without a name" + at(lt);
    // Attributes: name="value" pairs, each value quoted.
    std::string_view rest = tag.substr(name_end);
    while (true) {
      const size_t start = rest.find_first_not_of(" \t\r\n");
      if (start == std::string_view::npos) break;
      if (closing) return "attributes in a closing tag" + at(lt);
      rest.remove_prefix(start);
      const size_t eq = rest.find('=');
      if (eq == std::string_view::npos || eq + 1 >= rest.size() || (rest[eq + 1] != '"' && rest[eq + 1] != '\'')) {
        return "unquoted or malformed attribute in <" + name + ">" + at(lt);
      }
      const size_t close = rest.find(rest[eq + 1], eq + 2);
      if (close == std::string_view::npos) return "unterminated attribute value" + at(lt);
      if (auto p = check_text(rest.substr(eq + 2, close - eq - 2), lt); !p.empty()) return p;
      rest.remove_prefix(close + 1);
    }
    if (closing) {
      if (open.empty() || open.back() != name) return "</" + name + "> does not close the open element" + at(lt);
      open.pop_back();
    } else {
      if (open.empty() && ++roots > 1) return "more than one root element" + at(lt);
      if (!self_closing) open.push_back(name);
    }
    i = gt + 1;
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  if (roots != 1) return "no root element";
  return {};
}

}  // namespace cfmo::testing
