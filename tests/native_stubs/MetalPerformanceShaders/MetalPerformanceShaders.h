// Stand-in for <MetalPerformanceShaders/MetalPerformanceShaders.h>: the one class PyTorch's
// ATen/mps/MPSStream.h names. Not Apple's header.
#pragma once

#include <Metal/Metal.h>

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end
