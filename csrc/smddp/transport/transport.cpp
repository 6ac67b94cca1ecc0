#include "smddp/transport/transport.h"

#include "smddp/transport/tcp/tcp.h"

namespace smddp {

std::unique_ptr<Transport> make_transport(int rank, int size, std::string secret,
                                          std::string group_name) {
  // A fabric's transport is chosen here (Note [Inter-host transports]).
  return std::make_unique<TcpMesh>(rank, size, std::move(secret), std::move(group_name));
}

}  // namespace smddp
