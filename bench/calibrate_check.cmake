# bench_collectives' real JSON calibrates the simulator: a short run of the 2-rank inproc
# all_reduce cases is written with --benchmark_out, then fedshard-sim --calibrate fits it and
# prints latency, busbw and the residuals of every point. Fails when either step fails or the
# fitted row is missing; the figures themselves are not checked (shared, noisy machines).
#   cmake -DBENCH=<bench_collectives> -DSIM=<fedshard-sim> -DOUT=<json> -P calibrate_check.cmake
foreach(var BENCH SIM OUT)
  if(NOT ${var})
    message(FATAL_ERROR "calibrate_check: expected -D${var}=..., found none")
  endif()
endforeach()
execute_process(
  COMMAND "${BENCH}" "--benchmark_filter=^bm_inproc/all_reduce/.*/ranks:2/"
          --benchmark_min_time=0.01 "--benchmark_out=${OUT}" --benchmark_out_format=json
  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "calibrate_check: ${BENCH} failed (${rc}): ${err}")
endif()
execute_process(COMMAND "${SIM}" --calibrate "${OUT}" --cluster h100-8gpu-node --gpus 8
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "calibrate_check: fedshard-sim --calibrate ${OUT} failed (${rc}): ${err}")
endif()
if(NOT out MATCHES "all_reduce +nvlink +2 +8 [^\n]*[0-9]\\.[0-9][0-9] +[0-9.]+ +[0-9.]+\n")
  message(FATAL_ERROR "calibrate_check: expected a fitted all_reduce row for 2 ranks, found none")
endif()
