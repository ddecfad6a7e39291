// The compiled engine: kernels of ours at the autocast dispatch key, in C++.
// (Being written; until then the module only reports what it was built against.)
#include <torch/extension.h>

namespace {
std::string built_against() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("built_against", &built_against, "The torch version this build was compiled against.");
}
