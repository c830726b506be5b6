"""gunicorn's settings for the web app: one gevent worker that holds thousands of Socket.IO connections.

gunicorn reads this file by path, so nothing of the web app is imported in the master: the worker
imports it only after gevent has patched the standard library (sockets, threads, locks, queues).
`python -m webapp` and the compose deployment both start `gunicorn -c webapp/gunicorn.conf.py`.
"""

import ctypes
import os
import resource
import signal

bind = f"{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '5000')}"
wsgi_app = "webapp.wsgi:app"
# One process: a Socket.IO session lives where it connected. More customers: more web processes
# behind a sticky load balancer, all on the same Redis message queue (docs/DEPLOYMENT.md).
workers = 1
worker_class = "gevent"
# Open connections (Socket.IO and HTTP) one web process serves at once; each is a greenlet, not a thread.
worker_connections = int(os.environ.get("WEB_CONNECTIONS", "10000"))
backlog = 4096                 # a burst of customers connecting at once waits in the kernel, not refused
keepalive = 5
graceful_timeout = 10          # open websockets never end by themselves: a stop gives streams this long
timeout = 60                   # a worker whose event loop stalls this long is replaced
accesslog = os.environ.get("WEB_ACCESS_LOG") or None   # e.g. "-" for stdout; off by default: one line per poll
# gunicorn's default, spelled out because it must name no request header: Authorization carries API keys
# (%(u)s is only the user name of Basic auth, never a password or a bearer token).
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" %({x-request-id}o)s'
errorlog = "-"
control_socket_disable = True   # gunicorn's control socket is one path per user: several web processes would share it
loglevel = os.environ.get("WEB_LOG_LEVEL", "info")

# Every connection is a file descriptor: allow as many as the system lets this process have.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _hard == resource.RLIM_INFINITY or _soft < _hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard if _hard != resource.RLIM_INFINITY else 65536, _hard))

PR_SET_PDEATHSIG = 1


def post_fork(server, worker):
    """The worker dies with the master: a web process killed outright takes its connections with it, and a
    restarted one finds its port free (Linux; elsewhere the worker notices within a second and stops)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != server.pid:   # the master died before the call took effect
        os._exit(1)
