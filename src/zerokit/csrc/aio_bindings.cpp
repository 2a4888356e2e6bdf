// Thin pybind11 binding of the async I/O engine: integers (fd, address, sizes) in, no torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "aio/crc32c.h"
#include "aio/engine.h"

namespace py = pybind11;
using zk_aio::Engine;

PYBIND11_MODULE(_aio, m) {
  m.doc() = "zerokit async NVMe I/O engine (O_DIRECT, block-parallel, CRC-32C)";
  m.attr("ALIGN") = zk_aio::kAlign;
  m.attr("ERR_SHORT") = zk_aio::kErrShort;
  m.attr("ERR_CHECKSUM") = zk_aio::kErrChecksum;

  m.def(
      "crc32c",
      [](std::uintptr_t ptr, int64_t nbytes, uint32_t seed) {
        py::gil_scoped_release nogil;
        return zk_aio::crc32c(seed, reinterpret_cast<const void*>(ptr),
                              static_cast<size_t>(nbytes));
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0);
  m.def("crc32c_impl", &zk_aio::crc32c_impl);

  py::class_<Engine>(m, "Engine")
      .def(py::init([](int64_t block_size, int queue_depth, int thread_count, bool single_submit,
                       bool overlap_events, const std::string& backend) {
             zk_aio::Config c;
             c.block_size = block_size;
             c.queue_depth = queue_depth;
             c.thread_count = thread_count;
             c.single_submit = single_submit;
             c.overlap_events = overlap_events;
             c.backend = backend;
             return new Engine(c);
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("thread_count"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("backend") = "auto")
      .def(
          "submit",
          [](Engine& e, bool write, int fd, bool direct, std::uintptr_t ptr, int64_t nbytes,
             int64_t offset, bool fsync, bool want_checksums,
             std::optional<std::vector<uint32_t>> expected) {
            return e.submit(write, fd, direct, reinterpret_cast<char*>(ptr), nbytes, offset,
                            fsync, want_checksums, expected ? &*expected : nullptr);
          },
          py::arg("write"), py::arg("fd"), py::arg("direct"), py::arg("ptr"), py::arg("nbytes"),
          py::arg("offset"), py::arg("fsync") = false, py::arg("want_checksums") = false,
          py::arg("expected") = py::none())
      .def("done", &Engine::done, py::arg("request"))
      .def(
          "wait",
          [](Engine& e, int64_t id) {
            zk_aio::Result r;
            {
              py::gil_scoped_release nogil;
              r = e.wait(id);
            }
            return py::make_tuple(r.err, r.err_offset, r.err_got, r.bytes, r.checksums);
          },
          py::arg("request"))
      .def("num_blocks", &Engine::num_blocks, py::arg("nbytes"), py::arg("offset"))
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("fallback_reason", &Engine::fallback_reason)
      .def_property_readonly("kernel_blocks", &Engine::kernel_blocks)
      .def_property_readonly("pool_blocks", &Engine::pool_blocks)
      .def("idle_s", [](const Engine& e) {
        auto t = e.idle_s();
        return py::make_tuple(t[0], t[1], t[2]);
      });
}
