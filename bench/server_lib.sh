# Sourced by the bench/*.sh scripts: a free loopback port, and stopping the one server a script started.
# Needs $py (the Python to run); sets $pid to "" and traps EXIT so the server never outlives the script.

free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

pid=""
stop_server() {  # only the server this script started, by its pid; it stops its own children
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 90); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  pid=""
}
trap stop_server EXIT
