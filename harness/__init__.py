"""What benchmarks and tests share to run the server as a process."""
