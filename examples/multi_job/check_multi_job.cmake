# The example_multi_job test (cmake -P): runs fedshard-multi-job with group 2 SIGKILLed
# between two syncs and restarted 5 s after it died (join timeout 2 s, so the others leave
# it out first). Passes when the launcher exits 0 and its output shows a round with group 2
# left out, then a later round with group 2 as a joiner that healed and said how long after
# its restart its first sync came.
#   cmake -DEXE=<fedshard-multi-job> [-DLAUNCHER=<command list>] -P check_multi_job.cmake
if(NOT EXE)
  message(FATAL_ERROR "check_multi_job.cmake: pass -DEXE=<path of fedshard-multi-job>")
endif()
set(command ${LAUNCHER} "${EXE}" --steps 400 --kill-group 2 --kill-at-step 45 --join-timeout 2
            --restart-after 5 --timeout 240)
string(REPLACE ";" " " shown "${command}")
message("running: ${shown}")
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")

set(problems "")
if(NOT rc EQUAL 0)
  list(APPEND problems "the launcher exited with '${rc}', expected 0")
endif()
string(FIND "${out}" "left out {2}" left_out)
string(FIND "${out}" "healed {2}" joined)
string(FIND "${out}" "[group 2] restarted" restarted)
string(FIND "${out}" "(healed: took group" healed)
string(REGEX MATCH "first sync [0-9]+\\.[0-9][0-9] s after this process started" rejoin "${out}")
if(left_out EQUAL -1)
  list(APPEND problems "no round left group 2 out ('left out {2}')")
endif()
if(restarted EQUAL -1)
  list(APPEND problems "group 2 was not restarted ('[group 2] restarted')")
endif()
if(joined EQUAL -1 OR healed EQUAL -1)
  list(APPEND problems "no round had group 2 as a joiner that healed ('healed {2}', '(healed: ...')")
elseif(NOT left_out EQUAL -1 AND joined LESS left_out)
  list(APPEND problems "group 2 joined before it was left out")
endif()
if(NOT rejoin)
  list(APPEND problems "the healed group did not report its restart-to-first-sync time")
endif()
if(problems)
  list(JOIN problems "\n  " text)
  message(FATAL_ERROR "example_multi_job failed:\n  ${text}")
endif()
message("example_multi_job: group 2 was left out, restarted and healed; the launcher exited 0")
