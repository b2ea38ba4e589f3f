// Cross-check with Python's `safetensors` package (tests/io/check_safetensors.py): files
// exported from a trained model load there with every tensor bit for bit, and a file that
// package wrote imports into a trainer with every tensor equal to its values.
//
// The Python comes from FEDSHARD_TEST_PYTHON (the environment at run time, else what CMake
// found at configure time). Without one the test prints why and exits with 77, which ctest
// reports as skipped; when CMake was told to require it, a missing one fails the test.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/io/safetensors.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "io/safetensors_runs.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::test;
namespace st = fedshard::safetensors;

namespace {

std::string python() {
  const char* env = std::getenv("FEDSHARD_TEST_PYTHON");
  return env != nullptr && *env != '\0' ? env : FEDSHARD_TEST_PYTHON;
}

/// A path in single quotes for the shell.
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// Runs check_safetensors.py with the arguments; returns its exit status and output.
std::pair<int, std::string> run_script(const std::vector<std::string>& args) {
  std::string cmd = quoted(python()) + " " + quoted(FEDSHARD_CHECK_SAFETENSORS_PY);
  for (const auto& a : args) cmd += " " + quoted(a);
  cmd += " 2>&1";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) FAIL("popen failed for: ", cmd);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

void write_floats(const fs::path& p, const std::vector<float>& v) {
  write_all(p, std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
}

std::vector<float> read_floats(const fs::path& p) {
  const std::string s = read_all(p);
  std::vector<float> v(s.size() / sizeof(float));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(float));
  return v;
}

}  // namespace

TEST_CASE(
    "files exported from fsdp 1x1x4 and fl_hsdp 2x1x2 load in Python's safetensors with "
    "every tensor bit for bit (f32, bf16, f16)") {
  temp_dir dir;
  for (const bool federated : {false, true}) {
    CAPTURE(federated);
    const dtype types[] = {dtype::f32, dtype::bf16, dtype::f16};
    model_values model;  // group 0's tensors at the export
    const mesh_shape shape = federated ? mesh_shape{2, 1, 2} : mesh_shape{1, 1, 4};
    spawn_ranks(shape.size(), [&](inproc::communicator& world) {
      mesh m(world, shape);
      auto run = [&](auto& t) {
        for (int s = 0; s < 3; ++s) t.step(batch_at(t, s));
        for (dtype d : types)
          st::export_safetensors(
              t, dir.path / fedshard::detail::concat(to_string(d), federated, ".safetensors"), d);
        auto values = tensors_of(t);
        if (world.rank() == 0) model = std::move(values);
      };
      if (federated) {
        mlp_trainer<fl_hsdp> t(m, mlp_model{});
        run(t);
      } else {
        mlp_trainer<fsdp> t(m, mlp_model{});
        run(t);
      }
    });
    REQUIRE(model.size() == 6);
    for (dtype d : types) {
      CAPTURE(to_string(d));
      nlohmann::json manifest;
      manifest["file"] =
          (dir.path / fedshard::detail::concat(to_string(d), federated, ".safetensors")).string();
      manifest["dtype"] = std::string(st::name_of(d));
      manifest["metadata"] = {{"format", "pt"}};
      for (const auto& [name, values] : model) {
        const auto ref = dir.path / fedshard::detail::concat(name, ".", to_string(d), ".ref");
        write_floats(ref, rounded(values, d));
        const auto shape_of = st::read_info(manifest["file"].get<std::string>()).find(name)->shape;
        manifest["tensors"][name] = {{"shape", shape_of}, {"reference", ref.string()}};
      }
      const auto mf = dir.path / "manifest.json";
      write_all(mf, manifest.dump());
      const auto [status, output] = run_script({"check", mf.string()});
      MESSAGE(output);
      CHECK(status == 0);
      if (d == dtype::f32 && !federated) {  // the control: one bit off is seen
        const auto ref = manifest["tensors"]["layer1.w1"]["reference"].get<std::string>();
        auto values = read_floats(ref);
        values[17] = std::nextafter(values[17], 1.0f);
        write_floats(ref, values);
        const auto [bad_status, bad_output] = run_script({"check", mf.string()});
        CHECK(bad_status == 1);
        CHECK(contains(bad_output, "layer1.w1: 1 of 256 values differ, first at 17"));
      }
    }
  }
}

TEST_CASE(
    "a file written by Python's safetensors (F32, F16, F64) imports into fsdp 1x1x3 with "
    "every tensor equal to Python's values") {
  temp_dir dir;
  const flat_layout l(mlp_model{}.units(), 1);
  nlohmann::json manifest;
  const char* types[] = {"F32", "F16", "F64"};
  int k = 0;
  for (const auto& u : l.units())
    for (const auto& s : u.tensors)
      manifest["tensors"][u.name + "." + s.name] = {{"shape", s.shape}, {"dtype", types[k++ % 3]}};
  const auto mf = dir.path / "manifest.json";
  write_all(mf, manifest.dump());
  const auto [status, output] = run_script({"write", mf.string(), dir.path.string()});
  MESSAGE(output);
  REQUIRE(status == 0);

  const auto file = dir.path / "pretrained.safetensors";
  std::vector<model_values> got(3);
  spawn_ranks(3, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 3});
    mlp_trainer<fsdp> t(m, mlp_model{});
    st::import_safetensors(t, file);
    got[static_cast<std::size_t>(world.rank())] = tensors_of(t);
    t.step(batch_at(t, 0));
  });
  for (const auto& [name, spec] : manifest["tensors"].items()) {
    CAPTURE(name);
    const auto want = read_floats(dir.path / (name + ".f32"));
    REQUIRE(want.size() == l.unit(l.find(name)->first).tensors[l.find(name)->second].numel);
    for (const auto& rank : got) CHECK(bit_equal(rank.at(name), want));
  }
}

int main(int argc, char** argv) {
  if (python().empty()) {
    if (FEDSHARD_TEST_PYTHON_REQUIRED) {
      std::printf("fedshard: FAILED: a Python with safetensors and numpy is required, none set\n");
      return 1;
    }
    std::printf(
        "fedshard: SKIPPED: no Python with the safetensors and numpy packages was found at "
        "configure time (run cmake/install-deps.sh, which makes one in /opt/fedshard/venv, or "
        "set FEDSHARD_TEST_PYTHON); the cross-check with Python's safetensors did not run\n");
    return 77;
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}
