/*
 * loopback_only.so: an LD_PRELOAD shim that keeps a test broker on the loopback interface.
 *
 * RocketMQ 5.x binds three of its listeners to the wildcard address with no setting to change it
 * (the proxy's gRPC server: NettyServerBuilder.forPort; the proxy's remoting server; the broker's HA
 * port), and its name server dials the host's primary address (NetworkUtil.getLocalAddress()) to
 * talk to itself. Test fixtures must bind 127.0.0.1 only and send nothing off loopback, so:
 *
 *  - bind() to 0.0.0.0 becomes 127.0.0.1; bind() to :: becomes ::ffff:127.0.0.1 on a dual-stack
 *    socket (what the JVM opens) and ::1 on an IPv6-only one.
 *  - connect() to one of this host's own non-loopback IPv4 addresses becomes 127.0.0.1 (same
 *    port): the process meant itself, and now reaches itself over loopback.
 *
 * Everything else passes through untouched. Built by tests/brokers/_native.py with
 *   cc -O2 -shared -fPIC -o loopback_only.so loopback_only.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*sockfn)(int, const struct sockaddr *, socklen_t);

static sockfn real_bind;
static sockfn real_connect;

#define MAX_LOCAL 64
static struct in_addr local_v4[MAX_LOCAL];
static int n_local_v4;
static pthread_once_t local_once = PTHREAD_ONCE_INIT;

static void load_local_addresses(void) {
    struct ifaddrs *ifa_list = NULL, *ifa;
    if (getifaddrs(&ifa_list) != 0) return;
    for (ifa = ifa_list; ifa != NULL && n_local_v4 < MAX_LOCAL; ifa = ifa->ifa_next) {
        if (ifa->ifa_addr == NULL || ifa->ifa_addr->sa_family != AF_INET) continue;
        struct in_addr a = ((struct sockaddr_in *)ifa->ifa_addr)->sin_addr;
        if ((ntohl(a.s_addr) >> 24) == 127) continue;
        local_v4[n_local_v4++] = a;
    }
    freeifaddrs(ifa_list);
}

static int is_local_non_loopback(struct in_addr a) {
    pthread_once(&local_once, load_local_addresses);
    for (int i = 0; i < n_local_v4; i++)
        if (local_v4[i].s_addr == a.s_addr) return 1;
    return 0;
}

static void set_v4_mapped_loopback(struct in6_addr *a) {
    memset(a, 0, sizeof *a);
    a->s6_addr[10] = 0xff;
    a->s6_addr[11] = 0xff;
    a->s6_addr[12] = 127;
    a->s6_addr[15] = 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (real_bind == NULL) real_bind = (sockfn)dlsym(RTLD_NEXT, "bind");
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (struct sockaddr *)&a, sizeof a);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            int v6only = 0;
            socklen_t optlen = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen) == 0 && v6only)
                a.sin6_addr = in6addr_loopback;
            else
                set_v4_mapped_loopback(&a.sin6_addr);
            return real_bind(fd, (struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    if (real_connect == NULL) real_connect = (sockfn)dlsym(RTLD_NEXT, "connect");
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (is_local_non_loopback(a.sin_addr)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_connect(fd, (struct sockaddr *)&a, sizeof a);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_V4MAPPED(&a.sin6_addr)) {
            struct in_addr v4;
            memcpy(&v4, &a.sin6_addr.s6_addr[12], 4);
            if (is_local_non_loopback(v4)) {
                set_v4_mapped_loopback(&a.sin6_addr);
                return real_connect(fd, (struct sockaddr *)&a, sizeof a);
            }
        }
    }
    return real_connect(fd, addr, len);
}
