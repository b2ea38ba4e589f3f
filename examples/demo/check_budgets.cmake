# The demo's budgets, end to end (issue 33 item 3). Run with -DEXE=<fedshard-demo>
# -DLAUNCHER=<launcher or empty> -DWORK=<scratch dir>.
#
# --token-budget 1000 on the mlp model: a step is 8 ranks x 16 examples = 128 tokens, so
# every row trains ceil(1000 / 128) = 8 steps and 1024 tokens.
#
# --time-budget 1.5 with an evaluation after every step: curves.csv holds each row's
# training seconds after every step; every row stops at the first step whose seconds reach
# 1.5 (the last point >= 1.5, the one before it < 1.5), so the rows train the same time and
# as many steps as that buys them.
set(common --eval-examples 64 --hidden 64 --algorithms hsdp,fl_hsdp)

execute_process(COMMAND ${LAUNCHER} ${EXE} ${common} --token-budget 1000 --eval-every 4
                        --out ${WORK}/tokens
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--token-budget run failed (${rc}):\n${out}\n${err}")
endif()
foreach(row "hsdp 1x2x4" "fl_hsdp 2x2x2")
  string(REPLACE " " " \\| " cells "${row}")  # name | mesh
  if(NOT out MATCHES "\\| ${cells} \\| 8 \\| 1024 \\|")
    message(FATAL_ERROR "--token-budget 1000: expected the row '${row}' to train 8 steps and "
                        "1024 tokens, found:\n${out}")
  endif()
endforeach()

execute_process(COMMAND ${LAUNCHER} ${EXE} ${common} --time-budget 1.5 --eval-every 1
                        --out ${WORK}/time
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--time-budget run failed (${rc}):\n${out}\n${err}")
endif()
file(STRINGS ${WORK}/time/curves.csv lines)
foreach(algo hsdp fl_hsdp)
  set(seconds "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^${algo},([0-9]+),[^,]+,([^,]+),")
      list(APPEND seconds ${CMAKE_MATCH_2})
    endif()
  endforeach()
  list(LENGTH seconds n)
  if(n LESS 3)
    message(FATAL_ERROR "--time-budget 1.5: expected ${algo} to train at least 2 steps, "
                        "found ${n} points in curves.csv:\n${out}")
  endif()
  math(EXPR last "${n} - 1")
  math(EXPR before "${n} - 2")
  list(GET seconds ${last} s_last)
  list(GET seconds ${before} s_before)
  if(s_last LESS 1.5 OR NOT s_before LESS 1.5)
    message(FATAL_ERROR "--time-budget 1.5: expected ${algo} to stop at the first step past "
                        "1.5 s, found ${s_before} s then ${s_last} s:\n${out}")
  endif()
endforeach()
if(NOT out MATCHES "1.5 s of training each")
  message(FATAL_ERROR "--time-budget 1.5: expected the budget in the header, found:\n${out}")
endif()
