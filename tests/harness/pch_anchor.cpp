// Anchor for the tests' shared precompiled header (tests/CMakeLists.txt).
