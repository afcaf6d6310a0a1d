// The Python module: kvpool.model.kernels loads it as one extension.
#include "kernels.h"

#include <atomic>
#include <utility>

namespace {

// Whether the kernels run without the GIL (they touch no Python object). Released, a worker's
// other threads run while a step computes: its background KV loads go on during decode steps
// (benchmarks/bench_overlap.py). But on a host whose cores the steps already fill, those
// threads (the server's event loop, RPCs, saves) then take a core from a step's OpenMP team
// mid-step and its barriers wait for them: under a load generator with no loads, serving ran
// ~10 % slower released than held (docs/benchmarks.md). So the engine releases it only for
// steps while loads are in flight (set_release_gil, llm_engine.py); the default, for other
// callers, is released.
std::atomic<bool> release_gil{true};

// call() without the GIL while release_gil is set, else holding it.
template <typename F>
auto under_policy(F&& call) {
  if (release_gil.load(std::memory_order_relaxed)) {
    py::gil_scoped_release unlocked;
    return call();
  }
  return call();
}

// A function or method bound under that policy.
template <typename R, typename... A>
auto gil_policy(R (*f)(A...)) {
  return [f](A... a) -> R { return under_policy([&] { return f(std::move(a)...); }); };
}

template <typename R, typename C, typename... A>
auto gil_policy(R (C::*f)(A...)) {
  return [f](C& c, A... a) -> R { return under_policy([&] { return (c.*f)(std::move(a)...); }); };
}

template <typename R, typename C, typename... A>
auto gil_policy(R (C::*f)(A...) const) {
  return [f](const C& c, A... a) -> R {
    return under_policy([&] { return (c.*f)(std::move(a)...); });
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_release_gil", [](bool on) { release_gil.store(on, std::memory_order_relaxed); },
        "whether the kernels run without the GIL from now on (default: yes)", py::arg("on"));
  m.def("release_gil", [] { return release_gil.load(std::memory_order_relaxed); },
        "whether the kernels run without the GIL");
  m.def("paged_decode_attention", gil_policy(&kvpool::paged_decode_attention),
        "decode attention over a paged block-major KV cache");
  m.def("qlinear", gil_policy(&kvpool::qlinear), "x . W^T over 32-block quantized weights (q4 / q8)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("out") = py::none(),
        py::arg("portable") = false, py::arg("wide") = true,
        py::arg("lanes_from") = kvpool::LANES_FROM, py::arg("packed") = py::none(),
        py::arg("act8") = false);
  m.def("gemv_pack", gil_policy(&kvpool::gemv_pack),
        "weights repacked for the few-row kernel (empty where it does not run)", py::arg("qs"),
        py::arg("q4"));
  m.attr("GEMV_ROWS") = kvpool::GEMV_ROWS;
  m.def("has_avx2", &kvpool::has_avx2, "whether the quantized kernel's AVX2 path is built in");
  m.def("has_avx512", &kvpool::has_avx512,
        "whether the quantized kernel's AVX-512 path is built in (used unless wide=False)");
  m.def("has_amx", &kvpool::has_amx,
        "whether AMX-BF16 tiles are built in and this process may use them");
  m.def("amx_pack", gil_policy(&kvpool::amx_pack),
        "float32 [N, K] weights packed in AMX tiles (bfloat16 hi and lo halves)", py::arg("w"));
  m.def("amx_linear", gil_policy(&kvpool::amx_linear),
        "x . W^T (+ bias) on AMX tiles, added to out where given", py::arg("x"), py::arg("packed"),
        py::arg("out") = py::none(), py::arg("bias") = py::none());
  m.def("amx_prefill_attention", gil_policy(&kvpool::amx_prefill_attention),
        "causal attention of a prompt chunk on AMX tiles", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("start_pos"), py::arg("scale"));
  py::class_<kvpool::DecodeModel>(m, "DecodeModel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor,
                    torch::Tensor>())
      .def("add_layer", &kvpool::DecodeModel::add_layer)
      .def("forward", gil_policy(&kvpool::DecodeModel::forward))
      .def("share_cores", &kvpool::DecodeModel::share_cores, py::arg("path"), py::arg("first"),
           py::arg("slots"), py::arg("cores"), py::arg("share"))
      .def_property_readonly("narrowed", &kvpool::DecodeModel::narrowed)
      .def("rope_rows_", gil_policy(&kvpool::DecodeModel::rope_rows_))
      .def("silu_mul_rows", gil_policy(&kvpool::DecodeModel::silu_mul_rows))
      .def("rms_rows", gil_policy(&kvpool::DecodeModel::rms_rows));
}
