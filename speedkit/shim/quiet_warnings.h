// Drops libtorch's warnings on this thread while alive. The dispatcher warns when a registration
// replaces a kernel, which is the point of an operator override: its registrations hold one.
#pragma once
#include <c10/util/Exception.h>

namespace sk {

class QuietWarnings {
 public:
  QuietWarnings() = default;
  QuietWarnings(const QuietWarnings&) = delete;
  QuietWarnings& operator=(const QuietWarnings&) = delete;

 private:
  struct Drop : c10::WarningHandler {
    void process(const c10::Warning&) override {}
  } handler_;
  c10::WarningUtils::WarningHandlerGuard guard_{&handler_};
};

}  // namespace sk
