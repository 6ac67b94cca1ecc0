// The single pybind11 module of torch_sagemaker: torch_sagemaker._C.
//
// Python decides, C++ executes: every function exported here has a Python wrapper with a
// docstring in torch_sagemaker/ (see torch_sagemaker/distributed/backend.py).
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native parts of torch_sagemaker (the smddp collective backend).";
  m.attr("has_smddp_backend") = false;
}
