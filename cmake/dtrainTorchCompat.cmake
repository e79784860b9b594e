# What dtrain needs from the project around it, given the libtorch it is
# built with: the C++ standard, and the same libtorch (version and C++ ABI).
# Used by dtrain's own build and, installed beside dtrainConfig.cmake, by
# every consumer's find_package(dtrain).

# A standard's number as a comparable one: 98 -> 3, 1z -> 17, 2a -> 20, ...
function(_dtrain_standard_number out value)
  set(map "98=3;03=3;0x=11;11=11;1y=14;14=14;1z=17;17=17;2a=20;20=20;2b=23;23=23;2c=26;26=26")
  foreach(pair IN LISTS map)
    string(REPLACE "=" ";" pair "${pair}")
    list(GET pair 0 key)
    list(GET pair 1 number)
    if(value STREQUAL key)
      set(${out} ${number} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

# The standard dtrain compiles with: C++17, or Torch's own when it demands a
# later one (libtorch 2.14's target says CXX_STANDARD 20; 1.13 says 14).
function(dtrain_torch_cxx_standard out)
  set(standard 17)
  if(TARGET torch)
    get_target_property(torch_standard torch CXX_STANDARD)
    if(torch_standard AND torch_standard GREATER standard AND NOT torch_standard EQUAL 98)
      set(standard ${torch_standard})
    endif()
  endif()
  set(${out} ${standard} PARENT_SCOPE)
endfunction()

# The libtorch's C++ ABI as its TORCH_CXX_FLAGS state it (0 or 1; empty
# when they do not say).
function(dtrain_torch_abi out)
  set(abi "")
  if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
    set(abi ${CMAKE_MATCH_1})
  endif()
  set(${out} "${abi}" PARENT_SCOPE)
endfunction()

# Refuses, with what to change, a project that forces a C++ standard older
# than `required` (CMAKE_CXX_STANDARD, or -std= in CMAKE_CXX_FLAGS): Torch's
# headers would stop it later with an #error that does not say where.
function(dtrain_check_cxx_standard required torch_version)
  set(forced "")
  if(DEFINED CMAKE_CXX_STANDARD AND NOT CMAKE_CXX_STANDARD STREQUAL "")
    _dtrain_standard_number(number "${CMAKE_CXX_STANDARD}")
    if(number AND number LESS required)
      set(forced "CMAKE_CXX_STANDARD ${CMAKE_CXX_STANDARD}")
    endif()
  endif()
  string(REGEX MATCHALL "-std=(c|gnu)\\+\\+[0-9a-z]+" flags "${CMAKE_CXX_FLAGS}")
  foreach(flag IN LISTS flags)
    string(REGEX REPLACE "^-std=(c|gnu)\\+\\+" "" value "${flag}")
    _dtrain_standard_number(number "${value}")
    if(number AND number LESS required)
      set(forced "${flag} in CMAKE_CXX_FLAGS")
    endif()
  endforeach()
  if(forced)
    message(FATAL_ERROR
      "dtrain: this project asks for an older C++ than libtorch ${torch_version} needs: it sets "
      "${forced}, and libtorch ${torch_version} needs C++${required}. Set CMAKE_CXX_STANDARD to "
      "${required} or later, or leave it unset (dtrain::dtrain asks for cxx_std_${required}).")
  endif()
endfunction()

# Refuses a libtorch other than the one dtrain was built with: another
# version or another C++ ABI links, then fails at run time (missing symbols,
# or crashes in std::string).
function(dtrain_check_same_torch built_version built_abi built_dir)
  dtrain_torch_abi(abi)
  set(found "libtorch ${Torch_VERSION}")
  set(built "libtorch ${built_version}")
  if(NOT abi STREQUAL "")
    string(APPEND found " (_GLIBCXX_USE_CXX11_ABI=${abi})")
  endif()
  if(NOT built_abi STREQUAL "")
    string(APPEND built " (_GLIBCXX_USE_CXX11_ABI=${built_abi})")
  endif()
  set(differs OFF)
  if(built_version AND Torch_VERSION AND NOT Torch_VERSION VERSION_EQUAL built_version)
    set(differs ON)
  endif()
  if(NOT built_abi STREQUAL "" AND NOT abi STREQUAL "" AND NOT abi STREQUAL built_abi)
    set(differs ON)
  endif()
  if(differs)
    message(FATAL_ERROR
      "dtrain: this project found ${found} in ${Torch_DIR}, but dtrain was built with ${built} "
      "from ${built_dir}. Use the same libtorch (point Torch_DIR or CMAKE_PREFIX_PATH at it), "
      "or rebuild dtrain against this one.")
  endif()
endfunction()
