import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):  # SHIM
    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    t.start()
    return t
