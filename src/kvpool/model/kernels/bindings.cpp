// The Python module: kvpool.model.kernels loads it as one extension.
#include "kernels.h"

// The kernels run without the GIL (they touch no Python object): a worker's other threads (its
// background KV loads and saves, its RPC servers) run while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &kvpool::paged_decode_attention,
        "decode attention over a paged block-major KV cache", nogil());
  m.def("qlinear", &kvpool::qlinear, "x . W^T over 32-block quantized weights (q4 / q8)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("out") = py::none(),
        py::arg("portable") = false, py::arg("wide") = true,
        py::arg("lanes_from") = kvpool::LANES_FROM, py::arg("packed") = py::none(),
        py::arg("act8") = false, nogil());
  m.def("gemv_pack", &kvpool::gemv_pack,
        "weights repacked for the few-row kernel (empty where it does not run)", py::arg("qs"),
        py::arg("q4"), nogil());
  m.attr("GEMV_ROWS") = kvpool::GEMV_ROWS;
  m.def("has_avx2", &kvpool::has_avx2, "whether the quantized kernel's AVX2 path is built in");
  m.def("has_avx512", &kvpool::has_avx512,
        "whether the quantized kernel's AVX-512 path is built in (used unless wide=False)");
  py::class_<kvpool::DecodeModel>(m, "DecodeModel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor,
                    torch::Tensor>())
      .def("add_layer", &kvpool::DecodeModel::add_layer)
      .def("forward", &kvpool::DecodeModel::forward, nogil())
      .def("share_cores", &kvpool::DecodeModel::share_cores, py::arg("path"), py::arg("first"),
           py::arg("slots"), py::arg("cores"), py::arg("share"))
      .def_property_readonly("narrowed", &kvpool::DecodeModel::narrowed)
      .def("rope_rows_", &kvpool::DecodeModel::rope_rows_, nogil())
      .def("silu_mul_rows", &kvpool::DecodeModel::silu_mul_rows, nogil());
}
