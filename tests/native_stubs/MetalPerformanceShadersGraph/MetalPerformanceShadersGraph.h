// Stand-in for <MetalPerformanceShadersGraph/MetalPerformanceShadersGraph.h>: the classes
// PyTorch's ATen/mps/MPSStream.h names. Not Apple's header.
#pragma once

#include <MetalPerformanceShaders/MetalPerformanceShaders.h>

@interface MPSGraph : NSObject
@end
@interface MPSGraphExecutionDescriptor : NSObject
@end
@interface MPSGraphCompilationDescriptor : NSObject
@end
